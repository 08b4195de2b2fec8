"""Attention backends side by side on CPU: eager, sdpa and flex (forward only: no CPU backward).

For each sequence length, with and without packed documents, in one process and interleaved
(every round runs each backend once, in rotated order), it measures
  - forward + backward time (eager, sdpa) and forward time (eager, sdpa, flex): median of rounds;
  - peak memory: the most bytes torch's CPU allocator had handed out during the call above what
    was live before it (torch.profiler memory events, summed in time order) — every tensor and
    every scratch buffer a kernel takes from the allocator, nothing of the interpreter or
    libraries (RSS would be mostly those). Measured in a separate profiled run.
Ratios are to sdpa. flex runs compiled (torch.compile of flex_attention, inductor's C++
kernel; compilation is excluded by a warm-up call). One thread, fp32, B=1.

    python benchmarks/bench_attention.py --out benchmarks/results/attention.md
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from hpctrain.ops.attention import ATTENTION_BACKENDS  # noqa: E402
from hpctrain.ops.documents import Documents  # noqa: E402


def make_docs(batch: int, length: int, *, mean: float, seed: int = 0,
              device: str = "cpu") -> Documents:
    """Rows packed with documents of exponentially distributed lengths (mean `mean`, ≥ 1);
    the last document of a row is cut at the row's end."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        ids, doc = [], 0
        while len(ids) < length:
            n = max(1, int(-mean * math.log(1.0 - torch.rand(1, generator=gen).item())))
            ids += [doc] * n
            doc += 1
        rows.append(ids[:length])
    return Documents.from_ids(torch.tensor(rows, device=device))


def attention_flops(docs: Documents | None, *, batch: int, length: int, heads: int,
                    head_dim: int, backward: bool) -> float:
    """Useful FLOPs of causal attention: 2·2·H per visible (query, key) pair forward (QKᵀ and
    PV), l(l+1)/2 pairs per document of length l; backward 2.5× forward (FlashAttention's
    convention). Masked-out pairs are not counted, so document masks lower the work."""
    if docs is None:
        pairs = batch * length * (length + 1) / 2
    else:
        pairs = sum(n * (n + 1) / 2 for row in docs.lengths() for n in row)
    forward = 4 * head_dim * heads * pairs
    return forward * (3.5 if backward else 1.0)


def peak_bytes(fn) -> int:
    """Peak bytes of torch's CPU allocator during fn(), above what was live before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # kineto_results is the one place the raw allocation events are exposed (torch 2.13).
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _inputs(args, length: int, *, grad: bool):
    gen = torch.Generator().manual_seed(1)
    shapes = [(args.batch, n, length, args.head_dim) for n in (args.heads, args.kv_heads,
                                                               args.kv_heads)]
    return [torch.randn(s, generator=gen).requires_grad_(grad) for s in shapes]


def _call(name: str, args, length: int, docs, *, backward: bool):
    fn = ATTENTION_BACKENDS[name]
    q, k, v = _inputs(args, length, grad=backward)
    if not backward:
        def forward():
            with torch.no_grad():
                fn(q, k, v, docs)
        return forward

    def forward_backward():
        fn(q, k, v, docs).sum().backward()
    return forward_backward


def measure(args, length: int, docs) -> dict[str, dict[str, float]]:
    """{mode/backend: {ms, mb}} for mode in fwdbwd (eager, sdpa) and fwd (all three)."""
    calls = {f"fwdbwd/{b}": _call(b, args, length, docs, backward=True)
             for b in ("eager", "sdpa")}
    calls |= {f"fwd/{b}": _call(b, args, length, docs, backward=False)
              for b in ("eager", "sdpa", "flex")}
    for call in calls.values():
        call()  # warm-up: flex compiles here
    times: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(args.rounds):
        for key in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            calls[key]()
            times[key].append(time.perf_counter() - t0)
    return {k: {"ms": 1e3 * statistics.median(times[k]), "mb": peak_bytes(calls[k]) / 2**20}
            for k in names}


def _row(length, docs, res, args) -> str:
    def ratio(mode, b, what):
        return res[f"{mode}/{b}"][what] / res[f"{mode}/sdpa"][what]

    n_docs = "1" if docs is None else f"{sum(len(r) for r in docs.lengths()) / args.batch:.0f}"
    flops = attention_flops(docs, batch=args.batch, length=length, heads=args.heads,
                            head_dim=args.head_dim, backward=True)
    gf = flops / res["fwdbwd/sdpa"]["ms"] / 1e6
    return (f"| {length} | {n_docs} | {res['fwdbwd/eager']['ms']:.1f} | "
            f"{res['fwdbwd/sdpa']['ms']:.1f} | {ratio('fwdbwd', 'eager', 'ms'):.2f} | {gf:.1f} | "
            f"{res['fwd/eager']['ms']:.1f} | {res['fwd/sdpa']['ms']:.1f} | "
            f"{res['fwd/flex']['ms']:.1f} | {ratio('fwd', 'eager', 'ms'):.2f} | "
            f"{ratio('fwd', 'flex', 'ms'):.2f} | {res['fwdbwd/eager']['mb']:.1f} | "
            f"{res['fwdbwd/sdpa']['mb']:.1f} | {ratio('fwdbwd', 'eager', 'mb'):.1f} | "
            f"{res['fwd/eager']['mb']:.1f} | {res['fwd/sdpa']['mb']:.1f} | "
            f"{res['fwd/flex']['mb']:.1f} | {ratio('fwd', 'flex', 'mb'):.2f} |")


HEADER = ("| L | docs/row | fwd+bwd ms eager | sdpa | eager/sdpa | sdpa GFLOP/s | fwd ms eager | "
          "sdpa | flex | eager/sdpa | flex/sdpa | fwd+bwd MiB eager | sdpa | eager/sdpa | "
          "fwd MiB eager | sdpa | flex | flex/sdpa |\n" + "|---" * 18 + "|")


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--doc-mean", type=float, default=256.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    # flex compiles per shape; past the default 8 graphs torch would silently run it unfused.
    torch._dynamo.config.recompile_limit = 64
    torch.set_num_threads(1)
    lines = [HEADER]
    for length in args.lengths:
        for docs in (None, make_docs(args.batch, length, mean=args.doc_mean)):
            lines.append(_row(length, docs, measure(args, length, docs), args))
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    if args.out:
        cmd = "python benchmarks/bench_attention.py " + " ".join(argv or sys.argv[1:])
        args.out.write_text(f"<!-- {cmd} -->\n{table}\n")
    return table


if __name__ == "__main__":
    main()

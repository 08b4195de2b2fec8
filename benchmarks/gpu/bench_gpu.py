"""GPU sections of benchmarks/gpu/run.sh; each writes <section>.json and <section>.md to --out.

  attention  bf16 forward+backward TFLOP/s (useful FLOPs: causal pairs inside documents only,
             bench_attention.attention_flops) and peak memory of sdpa, triton, flex and flash
             (when importable) at L = 1k, 4k, 16k (--lengths), B·L = 16k tokens, 16 query and
             4 kv heads of dim 128, with and without packed documents (mean 1,024 tokens).
             A backend that fails records its error; the others go on.
  mfu        a ~1B Llama (model=llama3_1b) trained a few steps by hpctrain's own Trainer
             (model + data-parallel engine, bf16, no checkpoint) with each backend: the median
             MFU, tokens/s and step time after --skip (2) warm-up steps, as the trainer
             computes them.
  fp8        the same ~1B Llama with sdpa in bf16 and bf16 + FP8 linears (train.fp8), eager and
             (when train.compile exists) with compiled blocks: tokens/s, MFU against the
             dense bf16 peak, speed-up over eager bf16.
  compile    eager bf16 vs train.compile=blocks bf16 on the ~1B Llama: tokens/s, MFU, compile
             time and the speed-up (bench_compile.py).

--dry-run: CPU, tiny sizes (fp64 attention; model=debug), to keep the script working without a
GPU. Sections to add later (fp8, compile) follow the same shape: a function in SECTIONS.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # run from a checkout

from bench_attention import attention_flops, make_docs  # noqa: E402
from bench_compile import init_single_process, model_overrides, section_compile  # noqa: E402

from hpctrain.ops.attention import ATTENTION_BACKENDS  # noqa: E402


def _backends(dry: bool) -> list[str]:
    names = ["sdpa", "triton", "flex"]
    if not dry and importlib.util.find_spec("flash_attn") is not None:
        names.append("flash")
    return names


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_mb(fn, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _attention_case(name, shape, docs, *, device, dtype, backward, args):
    B, N, K, L, H = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, L, n, H, device=device, dtype=dtype, generator=gen)
               .transpose(1, 2).requires_grad_(backward) for n in (N, K, K))
    fn = ATTENTION_BACKENDS[name]

    def call():
        with torch.set_grad_enabled(backward):
            out = fn(q, k, v, docs)
        if backward:
            out.backward(torch.ones_like(out))

    seconds = _time(call, device, warmup=args.warmup, iters=args.iters)
    flops = attention_flops(docs, batch=B, length=L, heads=N, head_dim=H, backward=backward)
    return {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12,
            "peak_mb": _peak_mb(call, device)}


def _directions(name: str, device: torch.device) -> tuple[bool, ...]:
    """backward? per case: fwd+bwd everywhere, forward only for flex on CPU (no backward)."""
    return (False,) if name == "flex" and device.type == "cpu" else (True,)


def section_attention(args, device) -> list[dict]:
    dtype = torch.float64 if args.dry_run else torch.bfloat16
    N, K, H = (2, 1, 16) if args.dry_run else (16, 4, 128)
    rows = []
    for L in args.lengths:
        B = max(1, args.tokens // L)
        for docs in (None, make_docs(B, L, mean=args.doc_mean, device=str(device))):
            for name in _backends(args.dry_run):
                for backward in _directions(name, device):
                    row = {"backend": name, "L": L, "B": B, "N": N, "K": K, "H": H,
                           "docs_per_row": 1 if docs is None else
                           sum(map(len, docs.lengths())) / B,
                           "direction": "fwd+bwd" if backward else "fwd"}
                    try:
                        row |= _attention_case(name, (B, N, K, L, H), docs, device=device,
                                               dtype=dtype, backward=backward, args=args)
                    except Exception as e:  # noqa: BLE001 - recorded, the others go on
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def section_mfu(args, device) -> list[dict]:
    over = model_overrides(args.dry_run, device) + [f"train.steps={args.steps}"]
    over += [] if args.dry_run else ["train.precision=bf16"]
    init_single_process(device)
    rows = []
    for name in _backends(args.dry_run) + (["eager"] if args.dry_run else []):
        row = {"backend": name} | _trainer_row([*over, f"model.attention={name}"], args, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _trainer_row(overrides: list[str], args, device) -> dict:
    """Median mfu, tokens/s and step time of hpctrain's Trainer after --skip warm-up steps,
    or the error (a refused or failing configuration is a result too)."""
    from hpctrain.distributed.dims import ParallelDims
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.train.trainer import Trainer
    from tests.conftest import make_config

    try:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = make_config(overrides, run_dir=run_dir)
            trainer = Trainer(cfg, build_mesh(ParallelDims(), rank=0, device=device))
            steps = [trainer.train_one() for _ in range(args.steps)][args.skip:]
            del trainer
        row = {k: statistics.median(s[k] for s in steps) if steps[0][k] is not None
               else None for k in ("mfu", "tokens_per_s", "step_time_s")}
    except Exception as e:  # noqa: BLE001 - recorded, the other rows go on
        row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def section_fp8(args, device) -> list[dict]:
    """~1B Llama (sdpa), bf16 vs bf16 + FP8 linears (tensorwise), eager, and compiled blocks
    when this version has train.compile: tokens/s, MFU (against the dense bf16 peak, FP8 runs
    too) and each row's speed-up over eager bf16. Goal at this size: FP8 ≥ 1.3× bf16."""
    from dataclasses import fields

    from hpctrain.config.schema import TrainConfig

    over = model_overrides(args.dry_run, device) + ["train.precision=bf16",
                                                    f"train.steps={args.steps}"]
    over += [] if args.dry_run else ["model.attention=sdpa"]
    compiles = ["none", "blocks"] if "compile" in {f.name for f in fields(TrainConfig)} else [None]
    init_single_process(device)
    rows = []
    for compile_ in compiles:
        for fp8 in (False, True):
            extra = [f"train.fp8={str(fp8).lower()}"]
            extra += [] if compile_ is None else [f"train.compile={compile_}"]
            row = {"compile": compile_ or "none", "fp8": fp8} | _trainer_row([*over, *extra],
                                                                            args, device)
            base = rows[0].get("tokens_per_s") if rows else row.get("tokens_per_s")
            if row.get("tokens_per_s") and base:
                row["speedup_vs_eager_bf16"] = row["tokens_per_s"] / base
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


SECTIONS = {"attention": section_attention, "mfu": section_mfu, "fp8": section_fp8,
            "compile": section_compile}


def _markdown(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|---" * len(keys) + "|"]
    for r in rows:
        cells = [f"{r[k]:.3g}" if isinstance(r.get(k), float)
                 else str(r.get(k, "")).replace("\n", " ").replace("|", "/") for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("section", choices=list(SECTIONS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    # Every (L, documents) pair compiles flex (and triton) once: 3 lengths fit the time budget.
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="B·L of each attention case")
    p.add_argument("--doc-mean", type=float, default=1024.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=8, help="mfu, compile: trainer steps per run")
    p.add_argument("--skip", type=int, default=2, help="mfu, compile: warm-up steps left out")
    args = p.parse_args(argv)
    # flex compiles per shape; past the default 8 graphs torch would silently run it unfused.
    torch._dynamo.config.recompile_limit = 64
    if args.dry_run:
        args.lengths, args.tokens, args.doc_mean, args.warmup, args.iters = [64], 64, 16.0, 1, 1
        args.steps, args.skip = 2, 1
    device = torch.device("cpu" if args.dry_run else "cuda")
    os.environ.setdefault("WANDB_SILENT", "true")
    rows = SECTIONS[args.section](args, device)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dry_run": args.dry_run, "argv": sys.argv[1:]}
    (args.out / f"{args.section}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (args.out / f"{args.section}.md").write_text(f"<!-- {json.dumps(meta)} -->\n"
                                                 + _markdown(rows))


if __name__ == "__main__":
    main()

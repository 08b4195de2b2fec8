"""Where a pipeline step's time goes: hpctrain vs torch.distributed.pipelining, per rank.

The same stages, microbatches and alternation as bench_pp's part 1 (its hp/torch variants are
reused). Per schedule and implementation, medians over the timed rounds, per rank:

  step     the whole step (schedule + update), as bench_pp times it (to the closing barrier)
  span     barrier → the end of this rank's schedule
  compute  the time inside F / B / W (hp) or forward / backward chunks (torch), and per kind
  update   step − span on this rank (the norm all-reduce waits for the slowest rank here)

and for hpctrain the *replay*: every step's measured action durations (both ranks) run again
through the simulator's dependency rules with zero communication time, i.e. the fastest the
schedule could have finished with exactly this compute; `measured / replay` is what the
runtime (hops, sends, receives, its own Python) adds on top of its compute.

torch's last stage computes the loss outside forward_one_chunk (not timed as forward), while
hpctrain's F includes it: compare the sum F + B(+W) per rank, not F alone.

    python benchmarks/pp_anatomy.py --steps 8 --warmup 2
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from bench_pp import SCHEDULES, hp_variant, pp_parser, torch_variant
from common import bench_config, median, spawn

from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.simulate import timelines


def replay(schedule, durations: list[dict[str, float]]) -> float:
    """Makespan of `schedule` with each compute action lasting its measured duration
    (durations[rank][str(action)]) and zero-cost hops: the simulator's dependency rules."""
    ranks = timelines(schedule, lambda rank, a: durations[rank][str(a)])
    return max(acts[-1][1] for acts in ranks if acts)


def _kind(label) -> str:
    return label.kind.value if hasattr(label, "kind") else str(label)


def worker(rank: int, world: int, args) -> dict:
    cfg = bench_config(layers=args.layers, dim=args.dim, seq=args.seq)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(cfg.vocab_size, (args.mb * args.microbatches, args.seq + 1),
                          generator=gen)
    steps = {}
    for name in args.schedules:
        steps["hp_" + name] = hp_variant(name, cfg, rank, args)
        steps["pt_" + name] = torch_variant(name, cfg, rank, args)
    names, rec = list(steps), {k: [] for k in steps}
    for r in range(args.warmup + args.steps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            _, timeline, span = steps[k](batch)
            step = time.perf_counter() - t0
            dist.barrier()
            if r >= args.warmup:
                kinds: dict[str, float] = {}
                for a0, a1, label in timeline:
                    kinds[_kind(label)] = kinds.get(_kind(label), 0.0) + a1 - a0
                rec[k].append({"step": step, "span": span, "kinds": kinds,
                               "durations": {str(lb): a1 - a0 for a0, a1, lb in timeline},
                               "end": max(a1 for _, a1, _ in timeline)})
    both = [None, None]
    dist.all_gather_object(both, rec)
    return {"ranks": both}


def report(res: dict, args) -> str:
    ranks = res["ranks"]
    lines = ["| schedule | impl | rank | step (ms) | span | compute | update | compute by kind "
             "(ms per step) |", "|---|---|---|---|---|---|---|---|"]
    replays = []
    for name in args.schedules:
        for impl in ("hp", "pt"):
            k = f"{impl}_{name}"
            for r, rec in enumerate(ranks):
                runs = rec[k]
                med = {f: 1e3 * median([x[f] for x in runs]) for f in ("step", "span")}
                busy = 1e3 * median([sum(x["kinds"].values()) for x in runs])
                upd = 1e3 * median([x["step"] - x["span"] for x in runs])
                kinds = sorted({kk for x in runs for kk in x["kinds"]})
                by_kind = ", ".join(
                    f"{kk} {1e3 * median([x['kinds'].get(kk, 0) for x in runs]):.1f}"
                    for kk in kinds)
                lines.append(f"| {name} | {impl} | {r} | {med['step']:.1f} | {med['span']:.1f} "
                             f"| {busy:.1f} | {upd:.1f} | {by_kind} |")
        sched = build_schedule(name, pp=2, microbatches=args.microbatches,
                               virtual_stages=SCHEDULES[name])
        ratios = []
        for i in range(args.steps):
            ideal = replay(sched, [rec["hp_" + name][i]["durations"] for rec in ranks])
            ratios.append(max(rec["hp_" + name][i]["end"] for rec in ranks) / ideal)
        replays.append(f"| {name} | {median(ratios):.3f} | {min(ratios):.3f}–{max(ratios):.3f} |")
    lines += ["", "hpctrain: last action's end (both ranks) / zero-latency replay of the same "
              "step's measured actions", "", "| schedule | median | min–max |", "|---|---|---|"]
    return "\n".join(lines + replays)


def main() -> None:
    ap = pp_parser(__doc__, steps=8)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    args = ap.parse_args()
    print(report(spawn(worker, args), args))


if __name__ == "__main__":
    main()

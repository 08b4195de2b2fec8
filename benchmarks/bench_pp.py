"""hpctrain pipeline schedules vs torch.distributed.pipelining on pp=2 gloo ranks (1 thread each).

Part 1, the real model: the same stages (same seed, same layer split, the torch side on an
nn.Linear copy) and the same microbatches, run as
  hpctrain 1f1b / interleaved_1f1b (v=2) / zbv  (PipelineRuntime on the lowered schedule)
  torch    Schedule1F1B / ScheduleInterleaved1F1B / ScheduleZBVZeroBubble  (torch PipelineStage)
interleaved A B A B …, rotating the order each round. Step = schedule + update: hpctrain's is
the trainer's (the DataParallel engine: global norm over pp, its fused AdamW on flat fp32
shards), torch's is `torch.optim.AdamW` (default implementation; the same hyper-parameters and
decay groups). The headline ratio is paired: hp / torch of the same round, whose two steps
ran back to back, median over rounds (on a shared host, load that drifts between rounds hits
both sides of a pair alike). The measured bubble is hpctrain's definition for both: per
rank 1 − (time in F/B/W compute) / (barrier → end of the schedule), max over ranks; the torch
side's compute is timed by wrapping its stages' forward_one_chunk / backward_one_chunk /
backward_weight_one_chunk.

Part 2, calibrated compute: hpctrain's PipelineRuntime drives fake stages (sleep_stages.py)
whose F, B and W sleep t_f, t_b, t_w (W deferred through the stage's WeightGradQueue, like
hpctrain's Linear), so the measured bubble is the schedule's, not CPU contention's; compared
with simulate() twice: at the nominal costs with t_comm = 0, and at the costs the run really
had (nominal + the measured overrun per sleep, t_comm = the measured one-way p2p latency),
which separates what the runtime adds from what the stages and the transport cost. The median
and the minimum over the steps are both reported: CPU contention only ever adds idle time or
overrun, so the minimum is the least disturbed step. A 2-chunk schedule (interleaved, zbv) gets
half the per-chunk cost, so every schedule does the same work.

    python benchmarks/bench_pp.py --steps 16 --warmup 2 --sleep-steps 10
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from common import bench_config, median, spawn, to_nn_linear
from sleep_stages import SleepLocal, SleepStage, mean_loss, p2p_one_way

from hpctrain.config.schema import OptimConfig
from hpctrain.distributed.mesh import own_group
from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.data.zero import NormSpec
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.simulate import simulate
from hpctrain.parallel.pipeline.stage import build_local_stages, stage_parts
from hpctrain.parallel.scaler import LossScaler
from hpctrain.parallel.step import lm_loss
from hpctrain.train.optim import param_groups
from hpctrain.train.pipeline import measured_bubble

SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2, "zbv": 1}  # name → virtual_stages argument
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
TORCH = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
         "zbv": "ScheduleZBVZeroBubble"}


# -- part 1: the real model ----------------------------------------------------------------------
def hp_variant(name: str, cfg, rank: int, args):
    """hpctrain's pipeline step as the trainer runs it: the schedule under the engine's
    no_sync, then the one update path (DataParallel: global norm over pp, fused AdamW)."""
    sched = build_schedule(name, pp=2, microbatches=args.microbatches,
                           virtual_stages=SCHEDULES[name])
    local, _ = build_local_stages(cfg, sched.stages_of(rank), n_stages=sched.n_stages, seed=0,
                                  tp_group=own_group())
    runtime = PipelineRuntime(lower_comm(sched), local, pp_rank=rank, peers=[0, 1],
                              act_shape=(args.mb, args.seq, cfg.dim), loss_fn=lm_loss)
    alone = own_group()  # dp=1
    engine = DataParallel(local, group=alone, batch_group=alone,
                          zero=0, precision="fp32", optim=OPTIM,
                          norm=NormSpec((dist.group.WORLD,)))
    scaler = LossScaler(enabled=False)

    def step(batch_BL):
        mbs = [(c[:, :-1], c[:, 1:]) for c in batch_BL.chunk(args.microbatches)]
        dist.barrier()
        start = time.perf_counter()
        with engine.reducer.no_sync():
            res = runtime.step(mbs, start=start)
        span = time.perf_counter() - start
        loss = None if res.loss_sum is None else float(res.loss_sum)
        engine.reduce_and_update(scaler=scaler, multiplier=1.0, grad_clip=0.0,
                                 loss=None if res.loss_sum is None else res.loss_sum.reshape(()))
        return loss, res.timeline, span

    return step


def _stage_ids(name: str, rank: int) -> list[int]:
    return {"1f1b": [rank], "interleaved_1f1b": [rank, rank + 2], "zbv": [rank, 3 - rank]}[name]


def _timed(stage, timeline: list, clock: dict) -> None:
    """Record (start, end) of the stage's compute calls relative to clock['start']."""
    def wrap(orig, kind: str):
        def wrapped(*a, **kw):
            t0 = time.perf_counter() - clock["start"]
            out = orig(*a, **kw)
            timeline.append((t0, time.perf_counter() - clock["start"], kind))
            return out

        return wrapped

    for meth in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(stage, meth, wrap(getattr(stage, meth), meth.split("_")[0]))


def torch_variant(name: str, cfg, rank: int, args):
    from torch.distributed import pipelining

    ids = _stage_ids(name, rank)
    n_stages = 2 * (2 if name != "1f1b" else 1)
    timeline, clock = [], {"start": 0.0}
    stages, params = [], []
    for s in ids:
        module = to_nn_linear(stage_parts(cfg, [s], n_stages=n_stages, seed=0)[s])
        params += list(module.parameters())
        st = pipelining.PipelineStage(module, s, n_stages, torch.device("cpu"))
        _timed(st, timeline, clock)
        stages.append(st)
    cls = getattr(pipelining, TORCH[name])
    sched = cls(stages[0] if name == "1f1b" else stages, args.microbatches, loss_fn=lm_loss)
    opt = torch.optim.AdamW(param_groups([(str(i), p) for i, p in enumerate(params)],
                                         OPTIM.weight_decay), lr=OPTIM.lr,
                            betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    holds = {"first": 0 in ids, "last": n_stages - 1 in ids}

    def step(batch_BL):
        opt.zero_grad(set_to_none=True)
        timeline.clear()
        losses = [] if holds["last"] else None
        x = (batch_BL[:, :-1],) if holds["first"] else ()
        target = batch_BL[:, 1:] if holds["last"] else None
        dist.barrier()
        clock["start"] = start = time.perf_counter()
        sched.step(*x, target=target, losses=losses)
        span = time.perf_counter() - start
        opt.step()
        loss = float(torch.stack(losses).mean()) if losses else None
        return loss, list(timeline), span

    return step


def _bubble(timeline, span) -> float:
    return measured_bubble(timeline, span, group=dist.group.WORLD)["bubble_measured"]


def real_model(rank: int, args) -> dict:
    cfg = bench_config(layers=args.layers, dim=args.dim, seq=args.seq)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(cfg.vocab_size, (args.mb * args.microbatches, args.seq + 1),
                          generator=gen)
    steps, errors = {}, {}
    for name in SCHEDULES:
        steps["hp_" + name] = hp_variant(name, cfg, rank, args)
        try:
            steps["pt_" + name] = torch_variant(name, cfg, rank, args)
        except Exception as e:  # noqa: BLE001 - report what torch does not support
            errors["pt_" + name] = f"{type(e).__name__}: {e}"
    first = {}
    for k in list(steps):
        try:
            loss, _, _ = steps[k](batch)
        except Exception as e:  # noqa: BLE001
            errors[k] = f"{type(e).__name__}: {str(e)[:300]}"
            del steps[k]
            continue
        both = [None, None]
        dist.all_gather_object(both, loss)
        first[k] = next(x for x in both if x is not None)
    names = list(steps)
    times, bubbles = {k: [] for k in names}, {k: [] for k in names}
    cpu = {k: [] for k in names}  # this process's CPU time (all its threads) per step
    for r in range(args.warmup + args.steps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _, timeline, span = steps[k](batch)
            c1 = time.process_time()
            dist.barrier()
            if r >= args.warmup:
                times[k].append(1e3 * (time.perf_counter() - t0))
                cpu[k].append(1e3 * (c1 - c0))
                bubbles[k].append(_bubble(timeline, span))
            else:
                _bubble(timeline, span)  # keep the collective sequence identical
    both = [None, None]
    dist.all_gather_object(both, cpu)
    cpu_ms = {k: [a + b for a, b in zip(both[0][k], both[1][k], strict=True)] for k in names}
    return {"first_loss": first, "times_ms": times, "bubbles": bubbles, "errors": errors,
            "cpu_ms": cpu_ms,
            "n_params": cfg.num_params(), "cfg": repr(cfg)}


# -- part 2: calibrated sleep-based stages ---------------------------------------------------
def overrun(timelines, t: tuple[float, float, float]) -> float:
    """Mean (measured − nominal) duration per sleep of the compute actions (both ranks): the
    stages' real cost beyond t_f/t_b/t_w (sleep overshoot, autograd, descheduling). A BW action
    sleeps twice (t_b then t_w)."""
    nominal = {"F": (t[0], 1), "B": (t[1], 1), "W": (t[2], 1), "BW": (t[1] + t[2], 2)}
    extra = sleeps = 0.0
    for t0, t1, a in timelines:
        cost, n = nominal[a.kind.value]
        extra, sleeps = extra + (t1 - t0 - cost), sleeps + n
    return extra / sleeps


def calibrated(rank: int, args) -> dict:
    """Each schedule on sleep stages; simulated twice: with the nominal costs (t_comm = 0) and
    with the costs the stages really took (nominal + measured overrun per sleep, t_comm = the
    measured one-way p2p latency)."""
    act_shape, out = (1, 4, 8), {}
    runs = {}
    for name in ("1f1b", "zb_h1", "interleaved_1f1b", "zbv"):
        sched = build_schedule(name, pp=2, microbatches=args.microbatches,
                               virtual_stages=2 if name == "interleaved_1f1b" else 1)
        t = tuple(x / sched.chunks for x in (args.t_f, args.t_b, args.t_w))
        local = SleepLocal({s: SleepStage(s, sched.n_stages, t, act_shape)
                            for s in sched.stages_of(rank)})
        runs[name] = (sched, t, PipelineRuntime(lower_comm(sched), local, pp_rank=rank,
                                                peers=[0, 1], act_shape=act_shape,
                                                loss_fn=mean_loss))
    mbs = [(torch.tensor([[i]]), torch.tensor([[i]])) for i in range(args.microbatches)]
    res = {name: {"bubble": [], "span": [], "timeline": []} for name in runs}
    for r in range(1 + args.sleep_steps):
        for name, (_, _, rt) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            tl = rt.step(mbs, start=start).timeline
            span = time.perf_counter() - start
            b = _bubble(tl, span)
            spans = [None, None]
            dist.all_gather_object(spans, span)
            if r > 0:
                res[name]["bubble"].append(b)
                res[name]["span"].append(max(spans))
                res[name]["timeline"] += tl
    t_comm = p2p_one_way(rank, act_shape)
    for name, (sched, t, _) in runs.items():
        both = [None, None]
        dist.all_gather_object(both, overrun(res[name]["timeline"], t))
        over = sum(both) / 2
        sim = simulate(sched, t_f=t[0], t_b=t[1], t_w=t[2], t_comm=0.0)
        real = simulate(sched, t_f=t[0] + over, t_b=t[1] + over, t_w=t[2] + over, t_comm=t_comm)
        out[name] = {"bubble_measured": median(res[name]["bubble"]),
                     "bubble_measured_min": min(res[name]["bubble"]),
                     "makespan_measured": median(res[name]["span"]),
                     "bubble_sim": sim.makespan_bubble_rate, "makespan_sim": sim.makespan,
                     "bubble_sim_real": real.makespan_bubble_rate,
                     "makespan_sim_real": real.makespan, "overrun": over, "t_comm": t_comm,
                     "bubble_sim_paper": sim.bubble_rate, "t": t}
    return out


def worker(rank: int, world: int, args) -> dict:
    out = {}
    if not args.skip_real:
        out["real"] = real_model(rank, args)
    out["calibrated"] = calibrated(rank, args)
    return out


def _paired(times: dict[str, list[float]], name: str) -> str:
    """hp / torch of the same round (run back to back, order rotated), median (min–max):
    load that changes between rounds hits both sides of a pair alike."""
    r = sorted(a / b for a, b in zip(times["hp_" + name], times["pt_" + name], strict=True))
    return f"**{median(r):.3f}** ({r[0]:.2f}–{r[-1]:.2f})"


def report(res: dict, args) -> str:
    lines = []
    if "real" in res:
        real = res["real"]
        med = {k: median(v) for k, v in real["times_ms"].items()}
        lines += [f"model: {real['cfg']}, {real['n_params'] / 1e6:.2f} M params; "
                  f"{args.microbatches} microbatches of {args.mb} x {args.seq}; "
                  f"{args.steps} timed rounds after {args.warmup} warm-up", "",
                  "| schedule | impl | step-1 loss | median step (ms) | min | max | "
                  "hp / torch (medians) | paired per-round hp / torch: median (min–max) | "
                  "measured bubble (median) | CPU ms per step, both ranks (median) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name in SCHEDULES:
            for impl in ("hp", "pt"):
                k = f"{impl}_{name}"
                if k not in med:
                    lines.append(f"| {name} | {impl} | — | failed | | | | | | |")
                    continue
                t, other = real["times_ms"][k], med.get("pt_" + name)
                ratio = f"{med[k] / other:.3f}" if impl == "hp" and other else ""
                paired = _paired(real["times_ms"], name) if impl == "hp" and other else ""
                lines.append(f"| {name} | {impl} | {real['first_loss'][k]:.7f} | {med[k]:.1f} | "
                             f"{min(t):.1f} | {max(t):.1f} | {ratio} | {paired} | "
                             f"{median(real['bubbles'][k]):.3f} | "
                             f"{median(real['cpu_ms'][k]):.0f} |")
        for k, e in real["errors"].items():
            lines += ["", f"{k} failed: {e}"]
        lines += ["", "raw step times (ms): " + "; ".join(
            f"{k}: " + " ".join(f"{x:.0f}" for x in v) for k, v in real["times_ms"].items())]
    cal = res["calibrated"]
    lines += ["", f"calibrated sleep stages, pp=2, m={args.microbatches}, per-rank costs "
              f"t_f={args.t_f * 1e3:.0f} t_b={args.t_b * 1e3:.0f} t_w={args.t_w * 1e3:.0f} ms "
              f"(split over chunks); median of {args.sleep_steps} steps", "",
              "| schedule | per-chunk t_f/t_b/t_w (ms) | measured bubble (median) | min | "
              "simulated bubble | measured / sim (median) | min / sim | overrun per sleep (ms) | "
              "t_comm (ms) | simulated at measured costs | measured / sim | measured makespan "
              "(ms) | sim | sim at measured costs |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in cal.items():
        tms = "/".join(f"{x * 1e3:.0f}" for x in c["t"])
        lines.append(f"| {name} | {tms} | {c['bubble_measured']:.4f} | "
                     f"{c['bubble_measured_min']:.4f} | {c['bubble_sim']:.4f} | "
                     f"{c['bubble_measured'] / c['bubble_sim']:.2f} | "
                     f"{c['bubble_measured_min'] / c['bubble_sim']:.2f} | "
                     f"{c['overrun'] * 1e3:.3f} | {c['t_comm'] * 1e3:.3f} | "
                     f"{c['bubble_sim_real']:.4f} | "
                     f"{c['bubble_measured'] / c['bubble_sim_real']:.2f} | "
                     f"{c['makespan_measured'] * 1e3:.1f} | {c['makespan_sim'] * 1e3:.1f} | "
                     f"{c['makespan_sim_real'] * 1e3:.1f} |")
    return "\n".join(lines)


def pp_parser(doc: str, *, steps: int) -> argparse.ArgumentParser:
    """The real-model options (rounds, microbatches, model size), shared with pp_anatomy."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mb", type=int, default=1, help="microbatch size")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    return ap


def main() -> None:
    ap = pp_parser(__doc__, steps=10)
    ap.add_argument("--t-f", type=float, default=0.04)
    ap.add_argument("--t-b", type=float, default=0.04)
    ap.add_argument("--t-w", type=float, default=0.04)
    ap.add_argument("--sleep-steps", type=int, default=5)
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args()
    print(report(spawn(worker, args), args))


if __name__ == "__main__":
    main()

"""The tiny MoE at ep = 1, 2, 4 against the dense model of the same active parameters, on
CPU/gloo ranks (fp32, dp = world, ZeRO-1).

Models: `bench_config` shape (dim 128, 4 layers); the MoE replaces every block's MLP by
E = 8 SwiGLU experts of width F/2, top-2, so a token passes through 2·F/2 = F hidden units,
as in the dense model (active parameters equal up to the router's D·E per layer).

Per layout, after warm-up, the median over steps of: the step time (slowest rank: barrier
before, max after), the share of it spent inside the experts' all-to-alls (count exchange,
dispatch, combine, forward and backward; timed around every `all_to_all_single` call of the
step), and per-rank bytes: expert parameters (should fall as 1/ep) and the engine's ledger
(parameters + gradients + optimizer state).

    python benchmarks/bench_moe.py --world 4 --steps 6

`--recompute none,selective,full` instead measures the MoE at ep = world under each activation
checkpointing mode: step time and the peak of saved-for-backward bytes of a step (the
trainer's ActivationMeter; parameters left out), max over ranks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_config, spawn  # noqa: E402
from hpctrain.config.schema import OptimConfig  # noqa: E402
from hpctrain.distributed.dims import ParallelDims  # noqa: E402
from hpctrain.distributed.mesh import build_mesh  # noqa: E402
from hpctrain.metrics.activations import ActivationMeter  # noqa: E402
from hpctrain.models import build_model  # noqa: E402
from hpctrain.models.checkpointing import apply_activation_checkpointing  # noqa: E402
from hpctrain.models.config import MoEConfig  # noqa: E402
from hpctrain.parallel.data.engine import DataParallel  # noqa: E402
from hpctrain.parallel.data.zero import NormSpec  # noqa: E402
from hpctrain.parallel.moe import apply_expert_parallel, dispatch  # noqa: E402
from hpctrain.parallel.scaler import LossScaler  # noqa: E402

OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1)


class A2ATimer:
    """Wall time spent inside dist.all_to_all_single while installed (benchmark-only wrap)."""

    def __init__(self):
        self.seconds, self._orig = 0.0, dispatch.dist.all_to_all_single

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._orig(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def layouts(world: int) -> list[tuple[str, int]]:
    return [("dense", 1)] + [(f"moe ep={ep}", ep) for ep in (1, 2, 4) if world % ep == 0]


def run_layout(name: str, ep: int, rank: int, world: int, args,
               recompute: str = "none") -> dict:
    base = bench_config(layers=4, dim=args.dim, seq=args.seq).with_(attention=args.attention)
    cfg = base if name == "dense" else base.with_(moe=MoEConfig(
        num_experts=8, top_k=2, every=1, expert_ffn_dim=base.ffn_dim // 2))
    mesh = build_mesh(ParallelDims(dp=world, ep=ep), rank=rank, device=torch.device("cpu"))
    model = build_model(cfg, seed=0)
    experts = apply_expert_parallel(model, mesh)
    apply_activation_checkpointing(model, recompute)
    meter = ActivationMeter(model.parameters())
    engine = DataParallel(model, group=mesh.dp_cp, batch_group=mesh.dp_cp,
                          zero=1, precision="fp32", optim=OPTIM,
                          experts=experts, norm=NormSpec())
    timer = A2ATimer()
    dispatch.dist.all_to_all_single = timer
    times, shares, saved = [], [], []
    try:
        for step in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            t = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len + 1), generator=g)
            dist.barrier()
            meter.reset()
            timer.seconds, t0 = 0.0, time.perf_counter()
            with meter:
                engine.train_step([(t[:, :-1], t[:, 1:])], n_micro=1, precision="fp32",
                                  scaler=LossScaler(enabled=False), grad_clip=1.0)
            dt = torch.tensor([time.perf_counter() - t0, timer.seconds, meter.peak_bytes],
                              dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times.append(float(dt[0]))
                shares.append(float(dt[1] / dt[0]))
                saved.append(int(dt[2]))
    finally:
        dispatch.dist.all_to_all_single = timer._orig
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if ".experts." in n)
    return {"layout": name, "recompute": recompute, "saved_bytes": max(saved),
            "active_params": cfg.num_params(active=True),
            "total_params": cfg.num_params(), "step_s": statistics.median(times),
            "a2a_share": statistics.median(shares), "expert_bytes_per_rank": expert_bytes,
            "state_bytes_per_rank": sum(v for k, v in engine.ledger().items()
                                        if k in ("mem_params_bytes", "mem_grads_bytes",
                                                 "mem_optim_bytes"))}


def bench(rank: int, world: int, args) -> list[dict]:
    if args.recompute:
        return [run_layout(f"moe ep={world}", world, rank, world, args, mode)
                for mode in args.recompute.split(",")]
    return [run_layout(name, ep, rank, world, args) for name, ep in layouts(world)]


def recompute_table(rows: list[dict]) -> str:
    first = rows[0]
    lines = ["| layout | recompute | step (ms) | vs first | saved activations (MiB / rank) | "
             "vs first |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['recompute']} | {1e3 * r['step_s']:.1f} | "
                     f"{r['step_s'] / first['step_s']:.2f}× | {r['saved_bytes'] / 2**20:.2f} | "
                     f"{r['saved_bytes'] / first['saved_bytes']:.2f}× |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    dense = rows[0]["step_s"]
    lines = ["| layout | active / total params | step (ms) | vs dense | all-to-all share | "
             "expert bytes / rank | model state bytes / rank |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['active_params']:,} / {r['total_params']:,} | "
                     f"{1e3 * r['step_s']:.1f} | {r['step_s'] / dense:.2f}× | "
                     f"{100 * r['a2a_share']:.1f}% | {r['expert_bytes_per_rank']:,} | "
                     f"{r['state_bytes_per_rank']:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--attention", default="sdpa", help="model.attention (eager keeps "
                        "the score matrix for backward, which selective recompute drops)")
    parser.add_argument("--recompute", default="",
                        help="e.g. none,selective,full: the MoE at ep=world under each mode")
    args = parser.parse_args()
    rows = spawn(bench, args, world=args.world)
    print(recompute_table(rows) if args.recompute else table(rows))


if __name__ == "__main__":
    main()

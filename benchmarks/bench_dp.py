"""hpctrain data parallelism side by side with torch's, in one run, on 2 CPU ranks (gloo, fp32).

Pairs (same model, same batches, same AdamW hyper-parameters, same bucket size):

  dp     hpctrain DataParallel(zero=0)  vs  DistributedDataParallel(gradient_as_bucket_view)
  zero1  hpctrain DataParallel(zero=1)  vs  DDP + ZeroRedundancyOptimizer(AdamW)
  zero3  hpctrain DataParallel(zero=3)  vs  FSDP2 fully_shard (every block, then the root)
  hsdp   hpctrain zero=3, dp_replicate=2  vs  FSDP2 fully_shard on a 2-D (replicate, shard) mesh
         (4 ranks: 2 replicas × 2 shards; run it alone, `--pairs hsdp`)

Each rank builds both engines of a pair and alternates their steps (A B A B …), so load from
other processes on a shared machine hits both alike. A step is fwd + bwd + optimizer with one
micro-batch; its time is the slowest rank's (barrier before, max over ranks after). Reported:
median step time after warm-up, the hpctrain/torch ratio, the dp-mean loss per step, and
per-rank bytes held after the optimizer step (storage de-duplicated by pointer; what is
counted for each engine is listed in `benchmarks/results/dp_zero.md`).

With `--alone` each engine instead runs by itself in a fresh world of rank processes, one
after the other (A B A B … for `--repeats`), so each rank's peak resident memory (VmHWM of
/proc/self/status, over the whole process: imports, build, every step) is that engine's
alone; reported per engine: median step time and the largest VmHWM of a rank. With `--meta`
both engines build their model on the meta device and fill only each rank's own elements
(hpctrain's trainer does so; for FSDP2 torchtitan's way: `fully_shard` on meta, `to_empty`,
each shard copied from the full initial value), so the set-up does not hold the whole model.

    python benchmarks/bench_dp.py --steps 8
    python benchmarks/bench_dp.py --steps 8 --pairs hsdp
    python benchmarks/bench_dp.py --alone --meta --pairs zero3 --steps 3 --warmup 1 \
        --dim 1024 --layers 24 --heads 16 --kv-heads 8 --ffn 2816   # model=medium's shape
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctrain.checkpoint.initial import init_from_seed  # noqa: E402
from hpctrain.config.schema import OptimConfig  # noqa: E402
from hpctrain.distributed.dims import ParallelDims  # noqa: E402
from hpctrain.distributed.mesh import build_mesh  # noqa: E402
from hpctrain.distributed.teardown import close_process_groups  # noqa: E402
from hpctrain.models import ModelConfig, build_model  # noqa: E402
from hpctrain.models.init import full_init  # noqa: E402
from hpctrain.parallel.data.engine import DataParallel  # noqa: E402
from hpctrain.parallel.data.zero import NormSpec  # noqa: E402
from hpctrain.parallel.memory import storage_bytes  # noqa: E402
from hpctrain.parallel.scaler import LossScaler  # noqa: E402
from hpctrain.parallel.state import parallel_state, placements  # noqa: E402
from hpctrain.parallel.step import lm_loss  # noqa: E402
from hpctrain.train.optim import param_groups  # noqa: E402

PAIRS = {"dp": (0, "ddp"), "zero1": (1, "zero_redundancy"), "zero3": (3, "fsdp2"),
         "hsdp": (3, "hsdp")}
WORLD = {"hsdp": 4}  # ranks a pair needs (2 otherwise)
REPLICAS = 2  # the hsdp pair's dp_replicate
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
MEM_KEYS = ("params", "grads", "optim", "comm")


def model_config(args) -> ModelConfig:
    return ModelConfig("bench", args.vocab, args.dim, args.layers, args.heads, args.kv_heads,
                       args.ffn, args.seq)


def batch(step: int, rank: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    tokens_BL = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return tokens_BL[:, :-1], tokens_BL[:, 1:]


def adamw(params) -> torch.optim.Optimizer:
    """torch's AdamW with hpctrain's decay groups (matrices decayed, norm gains not)."""
    return torch.optim.AdamW(param_groups(list(params), OPTIM.weight_decay), lr=OPTIM.lr,
                             betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)


# -- engines -------------------------------------------------------------------------------------
@dataclass
class Engine:
    name: str
    step: object  # (x_BL, y_BL, measure: bool) -> local loss tensor
    mem: dict[str, int] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)


def hpctrain_engine(zero: int, args, *, replicas: int = 1) -> Engine:
    """--meta: built as the trainer builds a rank (hpctrain.train.setup): on the meta device,
    the engine's units the first memory, the rank's own elements computed from the seed."""
    with torch.device("meta") if args.meta else contextlib.nullcontext():
        model = build_model(model_config(args), seed=0)
    dims = ParallelDims(dp=dist.get_world_size(), dp_replicate=replicas)
    mesh = build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu"))
    groups = {"group": dist.group.WORLD, "batch_group": dist.group.WORLD}
    if replicas > 1:  # HSDP through the run's own mesh (hpctrain.distributed.mesh)
        groups = {"group": mesh.shard, "replicas": mesh.replicate, "batch_group": mesh.dp_cp}
    engine = DataParallel(model, zero=zero, precision="fp32", optim=OPTIM,
                          bucket_mb=args.bucket_mb, norm=NormSpec(), device=torch.device("cpu"),
                          **groups)
    if args.meta:
        placed = placements(model, tp_plan=None, stages=None, tied=None)
        init_from_seed(parallel_state(model, placed, mesh=mesh, engine=engine),
                       model_config(args), seed=0)
    scaler = LossScaler(enabled=False)
    out = Engine(f"hpctrain zero={zero}" + (f" dp_replicate={replicas}" if replicas > 1 else ""),
                 None)

    def step(x_BL, y_BL, measure: bool):
        res = engine.train_step([(x_BL, y_BL)], n_micro=1, precision="fp32", scaler=scaler,
                                grad_clip=0.0)
        if measure:  # gradients are zeroed, not freed, by train_step: the ledger still sees them
            led = engine.ledger()
            out.mem = {"params": led["mem_params_bytes"], "grads": led["mem_grads_bytes"],
                       "optim": led["mem_optim_bytes"], "comm": 0}
            out.notes["units"] = len(engine.units)
            if engine.zero3 is not None:
                out.notes["zero3_peak_param_bytes"] = engine.zero3.peak_bytes
        return torch.tensor(res.loss, dtype=torch.float64)  # already the dp mean

    out.step = step
    return out


def torch_step(model, opt, out: Engine, measure_fn):
    def step(x_BL, y_BL, measure: bool):
        loss = lm_loss(model(x_BL), y_BL)
        loss.backward()
        opt.step()
        if measure:
            out.mem, extra = measure_fn()
            out.notes.update(extra)
        opt.zero_grad()
        return loss.detach()

    return step


def ddp_engine(args, *, zero_redundancy: bool) -> Engine:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(model_config(args), seed=0)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    named = list(model.named_parameters())
    if zero_redundancy:
        opt = ZeroRedundancyOptimizer(param_groups(named, OPTIM.weight_decay),
                                      optimizer_class=torch.optim.AdamW, lr=OPTIM.lr,
                                      betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
        local = opt.optim
    else:
        opt = local = adamw(named)
    out = Engine("torch DDP+ZeroRedundancyOptimizer" if zero_redundancy else "torch DDP", None)

    def measure():
        seen: set[int] = set()
        params = [p for _, p in named]
        buckets = ddp.reducer._get_zeros_like_grad_buckets()  # same sizes as DDP's buckets
        grads = [p.grad for p in params]
        grad_storages = {g.untyped_storage().data_ptr() for g in grads if g is not None}
        mem = {"params": storage_bytes(params, seen), "grads": storage_bytes(grads, seen),
               "optim": storage_bytes(_state_tensors(local), seen)}
        bucket_bytes = sum(b.buffer().nbytes for b in buckets)
        # gradient_as_bucket_view: p.grad are views into the buckets, so the buckets are the
        # gradient storages (checked: same count, same bytes); otherwise they come on top.
        is_view = len(grad_storages) == len(buckets) and mem["grads"] == bucket_bytes
        mem["comm"] = 0 if is_view else bucket_bytes
        return mem, {"ddp_buckets": len(buckets), "ddp_bucket_bytes": bucket_bytes,
                     "grads_are_bucket_views": is_view}

    out.step = torch_step(ddp, opt, out, measure)
    return out


def fsdp2_engine(args, *, replicas: int = 1) -> Engine:
    """FSDP2; replicas > 1: HSDP on a 2-D (replicate, shard) mesh, shard fastest (hpctrain's
    rank order too)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.device("meta") if args.meta else contextlib.nullcontext():
        model = build_model(model_config(args), seed=0)
    world = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (world,)) if replicas == 1 else
            init_device_mesh("cpu", (replicas, world // replicas),
                             mesh_dim_names=("replicate", "shard")))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.meta:  # torchtitan's way: shard on meta, allocate the shards, fill them
        model.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                full = full_init(name, p.shape, model_config(args), seed=0)
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements,
                                                     src_data_rank=None).to_local())
    named = list(model.named_parameters())
    opt = adamw(named)
    out = Engine("torch FSDP2" + (f" HSDP {replicas}×{world // replicas}" if replicas > 1
                                  else ""), None)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def measure():
        seen: set[int] = set()
        params = [p for _, p in model.named_parameters()]
        resharded = all(isinstance(p, DTensor) for p in params)
        mem = {"params": storage_bytes([local(p) for p in params], seen),
               "grads": storage_bytes([local(p.grad) for p in params], seen),
               "optim": storage_bytes([local(t) for t in _state_tensors(opt)], seen), "comm": 0}
        return mem, {"params_resharded_at_measure": resharded}

    out.step = torch_step(model, opt, out, measure)
    return out


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def build_engine(pair: str, which: int, args) -> Engine:
    """Engine `which` of `pair`: 0 hpctrain's, 1 torch's."""
    zero, peer = PAIRS[pair]
    replicas = REPLICAS if peer == "hsdp" else 1
    if which == 0:
        return hpctrain_engine(zero, args, replicas=replicas)
    if peer in ("hsdp", "fsdp2"):
        return fsdp2_engine(args, replicas=replicas)
    return ddp_engine(args, zero_redundancy=peer == "zero_redundancy")


def build_pair(pair: str, args) -> tuple[Engine, Engine]:
    return build_engine(pair, 0, args), build_engine(pair, 1, args)


# -- measurement ---------------------------------------------------------------------------------
def timed_step(engine: Engine, step: int, args, *, measure: bool) -> tuple[float, float]:
    """(slowest rank's seconds, dp-mean loss) of one step."""
    x_BL, y_BL = batch(step, dist.get_rank(), args)
    dist.barrier()
    t0 = time.perf_counter()
    loss = engine.step(x_BL, y_BL, measure)
    elapsed = time.perf_counter() - t0
    stats = torch.tensor([elapsed, float(loss)], dtype=torch.float64)
    dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
    if engine.name.startswith("torch"):
        dist.all_reduce(stats[1:])
        stats[1] /= dist.get_world_size()
    return float(stats[0]), float(stats[1])


def run_pair(pair: str, args) -> dict:
    engines = build_pair(pair, args)
    times: dict[str, list[float]] = {e.name: [] for e in engines}
    losses: dict[str, list[float]] = {e.name: [] for e in engines}
    for step in range(args.warmup + args.steps):
        order = engines if step % 2 == 0 else engines[::-1]  # A B, B A: no fixed position
        for engine in order:
            t, loss = timed_step(engine, step, args, measure=step == args.warmup - 1)
            losses[engine.name].append(loss)
            if step >= args.warmup:
                times[engine.name].append(t)
    by_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, {e.name: e.mem for e in engines})
    mem = {e.name: {k: max(r[e.name][k] for r in by_rank) for k in MEM_KEYS} for e in engines}
    return {"pair": pair, "engines": [e.name for e in engines], "times": times,
            "losses": losses, "mem": mem, "mem_by_rank": by_rank,
            "notes": {e.name: e.notes for e in engines}}


def vm_hwm_bytes() -> int:
    """This process's peak resident memory (VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def run_alone(pair: str, which: int, args) -> dict:
    """One engine of `pair` by itself in this world: its step times, losses and each rank's
    VmHWM at the end."""
    engine = build_engine(pair, which, args)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        t, loss = timed_step(engine, step, args, measure=False)
        losses.append(loss)
        if step >= args.warmup:
            times.append(t)
    hwm: list = [None] * dist.get_world_size()
    dist.all_gather_object(hwm, vm_hwm_bytes())
    return {"pair": pair, "engine": engine.name, "times": times, "losses": losses, "hwm": hwm}


def profile_pair(pair: str, args) -> dict[str, str]:
    """torch.profiler over `args.steps` steps of each engine (after warm-up), rank 0's view."""
    from torch.profiler import ProfilerActivity, profile, record_function

    tables = {}
    for engine in build_pair(pair, args):
        for step in range(args.warmup):
            timed_step(engine, step, args, measure=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(args.warmup, args.warmup + args.steps):
                with record_function("## step"):
                    timed_step(engine, step, args, measure=False)
        tables[engine.name] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                        row_limit=args.profile_rows)
        del engine
    return tables


def rank_main(rank: int, world: int, store_path: str, args, results) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    finished = False
    try:
        if args.profile:
            out = {pair: profile_pair(pair, args) for pair in args.pairs}
        elif args.alone_run is not None:
            out = run_alone(*args.alone_run, args)
        else:
            out = [run_pair(pair, args) for pair in args.pairs]
        if rank == 0:
            results["out"] = out
        finished = True
    finally:
        close_process_groups(clean=finished)


# -- report --------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def report(out: list[dict], args) -> str:
    lines = ["| pair | engine | median step (s) | min step (s) | ratio of medians | ratio of "
             "mins | paired per-step ratio: median (min–max) |", "|---|---|---|---|---|---|---|"]
    mem_lines = ["| pair | engine | params MiB | grads MiB | optim MiB | comm MiB | total MiB |",
                 "|---|---|---|---|---|---|---|"]
    loss_lines = ["| pair | step-1 loss hpctrain | step-1 loss torch | |Δ| step 1 | "
                  f"loss step {args.warmup + args.steps} hpctrain | torch | rel. Δ |",
                  "|---|---|---|---|---|---|---|"]
    for r in out:
        ours, peer = r["engines"]
        t_ours, t_peer = r["times"][ours], r["times"][peer]
        med = {n: statistics.median(r["times"][n]) for n in (ours, peer)}
        low = {n: min(r["times"][n]) for n in (ours, peer)}
        per = [a / b for a, b in zip(t_ours, t_peer, strict=True)]
        lines.append(f"| {r['pair']} | {ours} | {med[ours]:.3f} | {low[ours]:.3f} | "
                     f"{med[ours] / med[peer]:.2f}× | {low[ours] / low[peer]:.2f}× | "
                     f"**{statistics.median(per):.2f}×** ({min(per):.2f}–{max(per):.2f}) |")
        lines.append(f"| {r['pair']} | {peer} | {med[peer]:.3f} | {low[peer]:.3f} | | | |")
        for name in (ours, peer):
            m = r["mem"][name]
            mem_lines.append(f"| {r['pair']} | {name} | "
                             + " | ".join(_mib(m[k]) for k in MEM_KEYS)
                             + f" | {_mib(sum(m[k] for k in MEM_KEYS))} |")
        lo, lp = r["losses"][ours], r["losses"][peer]
        loss_lines.append(f"| {r['pair']} | {lo[0]:.6f} | {lp[0]:.6f} | {abs(lo[0] - lp[0]):.1e} "
                          f"| {lo[-1]:.6f} | {lp[-1]:.6f} | {abs(lo[-1] - lp[-1]) / lp[-1]:.1e} |")
    notes = [f"- {r['pair']} / {name}: {json.dumps(n)}" for r in out
             for name, n in r["notes"].items() if n]
    notes += [f"- {r['pair']} / {name}: total MiB by rank "
              + ", ".join(_mib(sum(m[name][k] for k in MEM_KEYS)) for m in r["mem_by_rank"])
              for r in out for name in r["engines"]]
    mem_title = "### Memory per rank (after optimizer.step; max over ranks per column)"
    return "\n".join(["### Step time", *lines, "", mem_title, *mem_lines, "",
                      "### Loss sanity", *loss_lines, "", "### Notes", *notes])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pairs", type=lambda s: s.split(","),
                   default=[pair for pair in PAIRS if pair not in WORLD])
    p.add_argument("--batch", type=int, default=2, help="samples per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout (s)")
    p.add_argument("--json", type=Path, default=None, help="also write raw results here")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing, print rank 0's torch.profiler table per engine")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--alone", action="store_true",
                   help="each engine alone in fresh rank processes: peak RSS (VmHWM) per rank")
    p.add_argument("--repeats", type=int, default=2, help="--alone: worlds per engine")
    p.add_argument("--meta", action="store_true",
                   help="build both engines' models on the meta device and fill only each "
                        "rank's own elements (hpctrain's trainer; torchtitan's FSDP2 set-up)")
    args = p.parse_args(argv)
    args.alone_run = None
    unknown = set(args.pairs) - set(PAIRS)
    if unknown:
        p.error(f"--pairs {sorted(unknown)} unknown: choose from {list(PAIRS)}")
    if len({WORLD.get(pair, 2) for pair in args.pairs}) > 1:
        p.error(f"--pairs {args.pairs}: hsdp needs {WORLD['hsdp']} ranks, the others 2: run "
                "it on its own")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (memory is measured on the last warm-up step)")
    return args


def run_world(world: int, args):
    """`rank_main` on `world` fresh rank processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(rank_main, args=(world, str(Path(tmp) / "store"), args, results),
                           nprocs=world, start_method="spawn", join=True)
        return results["out"]


def alone_report(runs: list[dict]) -> str:
    """Per pair: each engine's median step time and largest VmHWM of a rank, the ratios."""
    lines = ["| pair | engine | median step (s) | peak RSS per rank, max (MiB) | VmHWM by rank "
             "and world (MiB) | first / last loss | step ratio | memory ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for pair in dict.fromkeys(r["pair"] for r in runs):
        mine = [r for r in runs if r["pair"] == pair]
        names = list(dict.fromkeys(r["engine"] for r in mine))
        med = {n: statistics.median(t for r in mine if r["engine"] == n for t in r["times"])
               for n in names}
        hwm = {n: max(h for r in mine if r["engine"] == n for h in r["hwm"]) for n in names}
        for n in names:
            runs_n = [r for r in mine if r["engine"] == n]
            by = "; ".join(", ".join(_mib(h) for h in r["hwm"]) for r in runs_n)
            ratio = (f"**{med[n] / med[names[1]]:.2f}×** | **{hwm[n] / hwm[names[1]]:.2f}×**"
                     if n == names[0] else " | ")
            lines.append(f"| {pair} | {n} | {med[n]:.3f} | {_mib(hwm[n])} | {by} | "
                         f"{runs_n[0]['losses'][0]:.6f} / {runs_n[0]['losses'][-1]:.6f} | "
                         f"{ratio} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = WORLD.get(args.pairs[0], 2)
    if args.alone:
        runs = []
        for pair in args.pairs:
            for _ in range(args.repeats):
                for which in (0, 1):
                    args.alone_run = (pair, which)
                    runs.append(run_world(world, args))
        print(f"model: {model_config(args).num_params() / 1e6:.1f}M params, dim {args.dim}, "
              f"{args.layers} layers, vocab {args.vocab}; batch {args.batch}×{args.seq} tokens "
              f"per rank; {world} ranks gloo, 1 thread each; fp32; each engine alone in "
              f"{args.repeats} fresh worlds (A B A B); warm-up {args.warmup}, timed {args.steps}")
        print(alone_report(runs))
        if args.json:
            args.json.write_text(json.dumps(runs, indent=1))
        return
    out = run_world(world, args)
    if args.profile:
        for pair, tables in out.items():
            for name, table in tables.items():
                print(f"## {pair}: {name} ({args.steps} steps, rank 0)\n{table}")
        return
    n = model_config(args).num_params()
    print(f"model: {n / 1e6:.1f}M params, dim {args.dim}, {args.layers} layers, vocab "
          f"{args.vocab}; batch {args.batch}×{args.seq} tokens per rank; {world} ranks gloo, "
          f"1 thread each; fp32; bucket {args.bucket_mb} MB; warm-up {args.warmup}, "
          f"timed {args.steps}")
    print(report(out, args))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""hpctrain tensor parallelism (tp=2, with and without sp) vs torch DTensor TP on 2 gloo ranks.

Every rank builds the same full model (fixed seed), then four tp=2 copies of it:
  hp      hpctrain apply_tensor_parallel(sp=False) + vocab_parallel_cross_entropy
  hp_sp   the same with sequence parallelism
  dt      torch parallelize_module: wq/wk/wv/w1/w3 Colwise, wo/w2 Rowwise, embedding Rowwise
          (vocab-parallel), output Colwise with Shard(-1) logits + loss_parallel()
  dt_sp   the torchtitan-style sequence-parallel plan (SequenceParallel norms,
          PrepareModuleInput before attention/MLP)
DTensor's styles need nn.Linear/nn.Embedding, so the torch side runs on a copy of the model
whose hpctrain Linears are nn.Linear with the same weights (see common.to_nn_linear).

A step is forward + backward + (hpctrain: sync_tp_grads) + AdamW; no clipping on either side.
Variants run interleaved, rotating the order each round; per-variant median after warm-up.

    python benchmarks/bench_tp.py --steps 10
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import CollectiveBytes, bench_config, median, spawn, state_bytes, to_nn_linear

from hpctrain.models import build_model
from hpctrain.parallel.step import lm_loss
from hpctrain.parallel.tensor import (
    apply_tensor_parallel,
    sync_tp_grads,
    vocab_parallel_cross_entropy,
)

VARIANTS = ("hp", "hp_sp", "dt", "dt_sp")


def make_hpctrain(full, cfg, *, sp: bool, lr: float):
    model = copy.deepcopy(full)
    plan = apply_tensor_parallel(model, group=dist.group.WORLD, sp=sp, cfg=cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = vocab_parallel_cross_entropy(logits, targets, group=plan.group,
                                            counter=plan.counter)
        loss.backward()
        sync_tp_grads(model.parameters(), plan)
        opt.step()
        return float(loss)

    return model, opt, step, plan


def _dtensor_plan(cfg, *, sp: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                  use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(cfg.n_layers):
        pre = f"layers.{i}."
        plan.update({pre + n: ColwiseParallel() for n in
                     ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")})
        plan.update({pre + n: RowwiseParallel(output_layouts=seq) for n in ("attn.wo", "mlp.w2")})
        if sp:
            plan[pre + "attn_norm"] = SequenceParallel()
            plan[pre + "mlp_norm"] = SequenceParallel()
            plan[pre + "attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                    desired_input_layouts=(Replicate(), None, None))
            plan[pre + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))
    return plan


def make_dtensor(full, cfg, *, sp: bool, lr: float, mesh):
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    model = to_nn_linear(full)
    parallelize_module(model, mesh, _dtensor_plan(cfg, sp=sp))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(inputs, targets):
        opt.zero_grad(set_to_none=True)
        logits = model(inputs)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt.step()
        return float(loss.full_tensor())

    return model, opt, step


def worker(rank: int, world: int, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    cfg = bench_config(layers=args.layers, dim=args.dim, seq=args.seq)
    full = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref_loss = float(lm_loss(full(inputs), targets))
    mesh = init_device_mesh("cpu", (world,))
    built = {}
    hp_counters = {}
    for sp, name in ((False, "hp"), (True, "hp_sp")):
        model, opt, step, plan = make_hpctrain(full, cfg, sp=sp, lr=args.lr)
        built[name] = (model, opt, step)
        hp_counters[name] = plan.counter
    for sp, name in ((False, "dt"), (True, "dt_sp")):
        built[name] = make_dtensor(full, cfg, sp=sp, lr=args.lr, mesh=mesh)

    # Step 1 of every variant: the loss must equal the single-process model's; step 2 (after
    # one AdamW update) checks that gradients and optimizer agree too.
    first = {name: [built[name][2](inputs, targets) for _ in range(2)] for name in VARIANTS}

    # Communication of one step: hpctrain's CommCounter, the dispatcher-level byte count (same
    # ring formulas) and torch's CommDebugMode collective counts.
    comm = {}
    for name in VARIANTS:
        if name in hp_counters:
            hp_counters[name].reset()
        counter = CollectiveBytes(world)
        debug = CommDebugMode()
        with debug, counter:
            built[name][2](inputs, targets)
        comm[name] = {
            "commcounter_bytes": hp_counters[name].total if name in hp_counters else None,
            "dispatch_bytes": sum(counter.bytes.values()),
            "dispatch_by_kind": counter.bytes,
            "dispatch_counts": counter.counts,
            "commdebug_counts": {str(k).split(".")[-1]: v
                                 for k, v in debug.get_comm_counts().items()},
        }

    times = {name: [] for name in VARIANTS}
    for r in range(args.warmup + args.steps):
        order = VARIANTS[r % 4:] + VARIANTS[:r % 4]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            built[name][2](inputs, targets)
            dist.barrier()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    mem = {name: state_bytes(built[name][0].parameters(), built[name][1]) for name in VARIANTS}
    prof = profile(built, inputs, targets) if args.profile and rank == 0 else None
    if args.profile and rank != 0:
        profile(built, inputs, targets)
    return {"ref_loss": ref_loss, "first_loss": first, "comm": comm, "mem": mem,
            "times_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
            "profile": prof, "n_params": cfg.num_params(), "cfg": repr(cfg)}


def profile(built, inputs, targets) -> dict:
    """Top self-CPU ops of one step per variant (both ranks must step together)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = {}
    for name in VARIANTS:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            built[name][2](inputs, targets)
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return out


def report(res: dict, args) -> str:
    med = {k: median(v) for k, v in res["times_ms"].items()}
    lines = [f"model: {res['cfg']}, {res['n_params'] / 1e6:.2f} M params; batch {args.batch} x "
             f"seq {args.seq}; {args.steps} timed rounds after {args.warmup} warm-up",
             f"single-process step-1 loss: {res['ref_loss']:.7f}", "",
             "| variant | step-1 loss | diff vs 1-proc | step-2 loss | diff vs hp | "
             "median step (ms) | min | max | ratio vs dt (same sp) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in VARIANTS:
        base = "dt_sp" if k.endswith("sp") else "dt"
        t = res["times_ms"][k]
        (l1, l2), hp2 = res["first_loss"][k], res["first_loss"]["hp"][1]
        lines.append(f"| {k} | {l1:.7f} | {abs(l1 - res['ref_loss']):.1e} | {l2:.7f} | "
                     f"{abs(l2 - hp2):.1e} | {med[k]:.1f} | {min(t):.1f} | {max(t):.1f} | "
                     f"{med[k] / med[base]:.3f} |")
    lines += ["", "| variant | params MB | grads MB | AdamW state MB | total MB |",
              "|---|---|---|---|---|"]
    for k in VARIANTS:
        m = res["mem"][k]
        lines.append(f"| {k} | {m['params'] / 1e6:.3f} | {m['grads'] / 1e6:.3f} | "
                     f"{m['optim'] / 1e6:.3f} | {m['total'] / 1e6:.3f} |")
    lines += ["", "| variant | CommCounter bytes/step | dispatcher bytes/step (by kind) | "
              "dispatcher counts | CommDebugMode counts |", "|---|---|---|---|---|"]
    for k in VARIANTS:
        c = res["comm"][k]
        cc = "—" if c["commcounter_bytes"] is None else f"{c['commcounter_bytes']:,}"
        kinds = ", ".join(f"{a} {b:,}" for a, b in sorted(c["dispatch_by_kind"].items()))
        counts = ", ".join(f"{a} {b}" for a, b in sorted(c["commdebug_counts"].items()))
        mine = ", ".join(f"{a} {b}" for a, b in sorted(c["dispatch_counts"].items()))
        lines.append(f"| {k} | {cc} | {c['dispatch_bytes']:,} ({kinds}) | {mine} | {counts} |")
    lines += ["", "raw step times (ms): " + "; ".join(
        f"{k}: " + " ".join(f"{x:.0f}" for x in res["times_ms"][k]) for k in VARIANTS)]
    if res.get("profile"):
        for k, table in res["profile"].items():
            lines += ["", f"profile {k} (rank 0, one step):", "```", table, "```"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(report(spawn(worker, args), args))


if __name__ == "__main__":
    main()

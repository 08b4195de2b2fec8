"""Rank-side functions for the expert-parallel tests (module-level: they are pickled).

Every rank builds the single-process reference from the same seed; the reference runs every
rank's micro-batches in one process (the router's losses are per micro-batch, as on the
ranks), the parallel run feeds each rank its own. Expert parameters are compared slice by
slice: rank r of its ep group holds experts [r·E/ep, (r+1)·E/ep).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh, group_rank
from hpctrain.models import PRESETS, build_model
from hpctrain.models.config import MoEConfig
from hpctrain.models.moe.layer import take_moe_stats, take_router_loss
from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.data.zero import NormSpec
from hpctrain.parallel.moe import apply_expert_parallel
from hpctrain.parallel.scaler import LossScaler
from hpctrain.parallel.step import lm_loss
from tests.parallel.dp_helpers import OPTIM, rank_micro_batches
from tests.references import reference_optimizer, reference_step


def moe_config(capacity: float = 0.0):
    moe = MoEConfig(num_experts=8, top_k=2, every=2, expert_ffn_dim=24, shared_experts=1,
                    aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=capacity)
    return PRESETS["debug"].with_(name="moe", moe=moe)


def _parallel(ep: int, *, zero: int, dtype, capacity: float):
    mesh = build_mesh(ParallelDims(dp=dist.get_world_size(), ep=ep), rank=dist.get_rank(),
                      device=torch.device("cpu"))
    model = build_model(moe_config(capacity), seed=0).to(dtype)
    experts = apply_expert_parallel(model, mesh)
    engine = DataParallel(model, group=mesh.dp_cp, batch_group=mesh.dp_cp,
                          zero=zero, precision="fp32", optim=OPTIM,
                          bucket_mb=0.01, experts=experts, norm=NormSpec())
    return mesh, model, engine


def _local(name: str, full: torch.Tensor, *, ep: int, ep_rank: int) -> torch.Tensor:
    """This rank's slice of a full reference tensor (experts: along the expert dim)."""
    if ".experts." not in name or ep == 1:
        return full
    n = full.shape[0] // ep
    return full[ep_rank * n:(ep_rank + 1) * n]


def _reference_grads(dp: int, accum: int, capacity: float):
    """Single process, fp64: (LM loss, grads by name, grad norm, per rank: kept assignments
    and assignments per expert summed over layers and micro-batches)."""
    model = build_model(moe_config(capacity), seed=0).double()
    lm, kept, routed = 0.0, [], []
    for r in range(dp):
        for x, y in rank_micro_batches(0, dp=dp, rank=r, accum=accum, vocab=512):
            loss = lm_loss(model(x), y) / (dp * accum)
            (loss + take_router_loss(model) / (dp * accum)).backward()
            lm += float(loss)
        stats = take_moe_stats(model)
        kept.append(sum(s.kept for s in stats))
        routed.append(sum(s.routed_E for s in stats))
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))
    return lm, grads, norm, kept, routed


def analytical_bytes(routed: list[torch.Tensor], *, rank: int, ep: int, dim: int) -> int:
    """fp64 bytes `rank` sends off-rank in one step's all-to-alls, from the routing: rows of
    its tokens whose expert lives on a peer (dispatch) plus rows its experts got from peers
    (combine), each once forward and once backward (dropless: every assignment is kept)."""
    n = len(routed[0]) // ep
    mine = slice(rank % ep * n, (rank % ep + 1) * n)
    peers = [s for s in range(rank // ep * ep, rank // ep * ep + ep) if s != rank]
    rows = int(routed[rank].sum() - routed[rank][mine].sum())
    rows += sum(int(routed[s][mine].sum()) for s in peers)
    return rows * dim * 8 * 2


def ep_gradients(ep: int, *, zero: int = 0, accum: int = 2, capacity: float = 0.0):
    """One fp64 step at `ep` (dp = world): max |Δ| of loss, every gradient and the clip norm
    against the single process, (kept, reference kept) assignments of this rank, and (bytes
    its all-to-alls sent, `analytical_bytes`)."""
    from hpctrain.parallel.moe import take_all_to_all_bytes

    dp, rank = dist.get_world_size(), dist.get_rank()
    mesh, model, engine = _parallel(ep, zero=zero, dtype=torch.float64, capacity=capacity)
    captured = {}

    def capture(*, unscale, max_norm, loss):  # keep the reduced gradients, skip the update
        from hpctrain.parallel.data.state import full_grad_state

        captured.update(full_grad_state(engine))  # the shards the optimizer would step on
        verdict = engine.optimizer.global_grad_norm(unscale=unscale, loss=loss)
        captured["norm"] = verdict.norm
        return verdict

    engine.optimizer.step = capture
    mbs = rank_micro_batches(0, dp=dp, rank=rank, accum=accum, vocab=512)
    result = engine.train_step(mbs, n_micro=accum, precision="fp32",
                               scaler=LossScaler(enabled=False), grad_clip=1.0)
    kept = sum(s.kept for s in take_moe_stats(model))
    sent = take_all_to_all_bytes(model)["comm_ep_bytes"]
    ref_loss, ref_grads, ref_norm, ref_kept, routed = _reference_grads(dp, accum, capacity)
    ep_rank = group_rank(mesh.ep)
    err = max(float((captured[n] - _local(n, g, ep=ep, ep_rank=ep_rank)).abs().max())
              for n, g in ref_grads.items())
    want = analytical_bytes(routed, rank=rank, ep=ep, dim=moe_config().dim)
    return (abs(result.loss - ref_loss), err, abs(captured["norm"] - ref_norm), kept,
            ref_kept[rank], sent, want)


def ep_trajectory(ep: int, *, zero: int, steps: int = 3):
    """fp32, `steps` steps at `ep` × dp = world with ZeRO `zero`: max |Δθ| against the single
    process (torch AdamW, global clip; the router losses join each micro-batch's loss)."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    mesh, model, engine = _parallel(ep, zero=zero, dtype=torch.float32, capacity=0.0)
    ref = build_model(moe_config(), seed=0)
    opt = reference_optimizer(ref, OPTIM)
    for step in range(steps):
        mbs = rank_micro_batches(step, dp=dp, rank=rank, accum=1, vocab=512)
        engine.train_step(mbs, n_micro=1, precision="fp32", scaler=LossScaler(enabled=False),
                          grad_clip=1.0)
        every = [m for r in range(dp)
                 for m in rank_micro_batches(step, dp=dp, rank=r, accum=1, vocab=512)]
        reference_step(ref, opt, every, n_micro=dp, grad_clip=1.0,
                       loss_fn=lambda lg, y: lm_loss(lg, y) + take_router_loss(ref))
    from hpctrain.parallel.data.state import full_model_state

    ep_rank = group_rank(mesh.ep)
    named = full_model_state(engine)  # masters gathered over each unit's group (ZeRO-3 too)
    return max(float((named[n] - _local(n, p, ep=ep, ep_rank=ep_rank)).abs().max())
               for n, p in ref.named_parameters())


def _state(mesh, model, engine):
    from hpctrain.parallel.state import parallel_state, placements

    placed = placements(model, tp_plan=None, stages=None, tied=None)
    return parallel_state(model, placed, mesh=mesh, engine=engine)


def _steps(engine, first: int, last: int) -> float:
    dp, rank, loss = dist.get_world_size(), dist.get_rank(), float("nan")
    for step in range(first, last):
        mbs = rank_micro_batches(step, dp=dp, rank=rank, accum=1, vocab=512)
        loss = engine.train_step(mbs, n_micro=1, precision="fp32",
                                 scaler=LossScaler(enabled=False), grad_clip=1.0).loss
    return loss


def save_at_ep(path: str, ep: int, *, zero: int):
    """fp64: 2 steps at `ep`, save, 1 more step: (loss of step 3, full params after it)."""
    from hpctrain.checkpoint import save_load as ckpt
    from hpctrain.parallel.data.state import full_model_state

    mesh, model, engine = _parallel(ep, zero=zero, dtype=torch.float64, capacity=0.0)
    _steps(engine, 0, 2)
    ckpt.save(ckpt.checkpoint_dir(path, 2), parallel=_state(mesh, model, engine),
              train_state={"step": 2}, rank_state={})
    loss = _steps(engine, 2, 3)
    return loss, _full_experts(mesh, full_model_state(engine), ep)


def resume_at_ep(path: str, ep: int, *, zero: int):
    """Load the step-2 checkpoint at `ep` and take step 3: (its loss, full params after it)."""
    from hpctrain.checkpoint import save_load as ckpt
    from hpctrain.parallel.data.state import full_model_state

    mesh, model, engine = _parallel(ep, zero=zero, dtype=torch.float64, capacity=0.0)
    state, _ = ckpt.load(ckpt.checkpoint_dir(path, 2), parallel=_state(mesh, model, engine))
    loss = _steps(engine, state["step"], 3)
    return loss, _full_experts(mesh, full_model_state(engine), ep)


def _full_experts(mesh, params: dict, ep: int) -> dict:
    """`params` with every expert slice all-gathered over the ep group to all E experts."""
    if ep == 1:
        return params
    out = dict(params)
    for name, t in params.items():
        if ".experts." in name:
            parts = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(parts, t.contiguous(), group=mesh.ep)
            out[name] = torch.cat(parts)
    return out


def trainer_moe(overrides: list[str], run_dir: str, steps: int = 3, *, compiled: bool = False):
    """The real Trainer with model=debug_moe: per step (loss, grad norm, moe metrics); with
    `compiled`, also its compile summary (train.compile in `overrides`)."""
    from tests.parallel.trainer_runs import run_trainer

    trainer = run_trainer(["model=debug_moe", *overrides], run_dir, steps=steps)
    keys = ("moe_load_cv", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max",
            "moe_dropped_fraction", "moe_aux_loss", "moe_z_loss", "comm_ep_bytes")
    history = [(m["loss"], m["grad_norm"], {k: m[k] for k in keys if k in m})
               for m in trainer.history]
    return (history, trainer.compile_watch.summary()) if compiled else history

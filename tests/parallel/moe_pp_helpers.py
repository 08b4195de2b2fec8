"""Rank-side functions for the MoE-inside-pipeline tests (module-level: they are pickled).

The model is moe_helpers' MoE debug shape: 4 blocks, routed experts in blocks 1 and 3, so at
pp=2 each stage holds one MoE layer and seeds its own router losses. The reference is the
single process on every micro-batch of the global batch, each micro-batch's loss being
(LM loss + aux + z) / n_micro, what the data-parallel step computes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh, group_rank, own_group
from hpctrain.metrics.moe import moe_metrics
from hpctrain.models import build_model
from hpctrain.models.moe.layer import MoE, take_moe_stats, take_router_loss
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.stage import build_local_stages
from hpctrain.parallel.scaler import LossScaler
from hpctrain.parallel.step import lm_loss
from tests.parallel.dp_helpers import MICRO, OPTIM, SEQ, rank_micro_batches
from tests.parallel.moe_helpers import _local, moe_config
from tests.references import reference_optimizer, reference_step


def _router_stats(model) -> dict[str, tuple[float, float]]:
    """Per MoE layer (by module name): (Σ aux, Σ z) over the forwards since the last call."""
    layers = [n for n, m in model.named_modules() if isinstance(m, MoE)]
    return {n: (s.aux, s.z) for n, s in zip(layers, take_moe_stats(model), strict=True)}


def pp_gradients(schedule: str, *, m: int = 4):
    """pp = world = 2, ep = 1, fp64: one runtime step of m micro-batches. Returns max |Δ| of
    the loss (last stage, else 0), of every gradient of this rank's stages and of each of its
    MoE layers' summed aux and z losses, against the single process."""
    torch.manual_seed(0)
    rank, pp = dist.get_rank(), dist.get_world_size()
    cfg = moe_config()
    sched = build_schedule(schedule, pp=pp, microbatches=m, virtual_stages=1)
    local, _ = build_local_stages(cfg, sched.stages_of(rank), n_stages=sched.n_stages, seed=0,
                                  tp_group=own_group())
    local.double()
    runtime = PipelineRuntime(lower_comm(sched), local, pp_rank=rank, peers=list(range(pp)),
                              act_shape=(MICRO, SEQ, cfg.dim), loss_fn=lm_loss)
    mbs = rank_micro_batches(0, dp=1, rank=0, accum=m, vocab=cfg.vocab_size)
    result = runtime.step(mbs)
    ref = build_model(cfg, seed=0).double()
    ref_loss = 0.0
    for x, y in mbs:
        loss = lm_loss(ref(x), y) / m
        (loss + take_router_loss(ref) / m).backward()
        ref_loss += float(loss)
    grads = dict(ref.named_parameters())
    got = {n: p.grad for n, p in local.named_parameters()}
    loss_err = 0.0 if result.loss_sum is None else abs(float(result.loss_sum) - ref_loss)
    grad_err = max(float((g - grads[n].grad).abs().max()) for n, g in got.items())
    want, have = _router_stats(ref), _router_stats(local)
    assert have and set(have) <= set(want), (have, want)
    router_err = max(abs(a - b) for n, v in have.items() for a, b in zip(v, want[n],
                                                                         strict=True))
    return loss_err, grad_err, router_err


def _pipeline_run(schedule: str, *, dp: int, ep: int, pp: int):
    """The trainer's own wiring (build_parallel_state: the state and its PipelineEngine)."""
    from hpctrain.train.setup import build_parallel_state
    from tests.conftest import make_config

    cfg = make_config([
        "model=debug_moe", "train=debug", "logger.wandb=disabled", f"parallel.dp={dp}",
        f"parallel.ep={ep}", f"parallel.pp={pp}", f"parallel.schedule={schedule}",
        f"train.micro_batch_size={MICRO}", f"train.seq_len={SEQ}",
        f"train.global_batch_size={MICRO * dp * pp}", f"optim.lr={OPTIM.lr}",
        f"optim.weight_decay={OPTIM.weight_decay}", f"optim.eps={OPTIM.eps}",
        f"cluster.procs_per_node={dist.get_world_size()}"])
    cfg = dataclasses.replace(cfg, model=moe_config())  # the shared shape (aux, z, shared)
    mesh = build_mesh(ParallelDims(dp=dp, ep=ep, pp=pp), rank=dist.get_rank(),
                      device=torch.device("cpu"))
    state, pipeline = build_parallel_state(cfg, mesh)
    return cfg, mesh, pipeline, state


def ep_pp_trajectory(schedule: str, *, steps: int = 3, dp: int = 2, ep: int = 2, pp: int = 2):
    """fp32, `steps` steps at dp × pp (ep inside dp) through the trainer's pipeline step;
    returns (max |Δθ| of this rank's parameters, max |Δ| of the logged moe_aux_loss and
    moe_z_loss per step) against the single process on every rank's micro-batches."""
    cfg, mesh, pipeline, state = _pipeline_run(schedule, dp=dp, ep=ep, pp=pp)
    m, dp_rank = pipeline.schedule.n_microbatches, mesh.coord("dp")
    ref = build_model(cfg.model, seed=cfg.train.seed)
    opt = reference_optimizer(ref, OPTIM)
    metric_err = 0.0
    for step in range(steps):
        mbs = rank_micro_batches(step, dp=dp, rank=dp_rank, accum=m, vocab=cfg.model.vocab_size)
        pipeline.train_step(state.engine, mbs, scaler=LossScaler(enabled=False), grad_clip=1.0)
        got = moe_metrics(state.model, group=mesh.group("dp"), device=mesh.device, sp_group=None,
                          pp_group=mesh.group("pp"))
        every = [b for r in range(dp)
                 for b in rank_micro_batches(step, dp=dp, rank=r, accum=m,
                                             vocab=cfg.model.vocab_size)]
        reference_step(ref, opt, every, n_micro=dp * m, grad_clip=1.0,
                       loss_fn=lambda lg, y: lm_loss(lg, y) + take_router_loss(ref))
        per_layer = _router_stats(ref).values()
        want = [sum(v[i] for v in per_layer) / len(every) for i in (0, 1)]
        metric_err = max(metric_err, abs(got["moe_aux_loss"] - want[0]),
                         abs(got["moe_z_loss"] - want[1]))
    from hpctrain.parallel.data.state import full_model_state

    ep_rank = group_rank(mesh.ep)
    named = full_model_state(state.engine)
    full = dict(ref.named_parameters())
    param_err = max(float((p - _local(n, full[n].detach(), ep=ep, ep_rank=ep_rank)).abs().max())
                    for n, p in named.items())
    return param_err, metric_err

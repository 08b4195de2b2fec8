"""What pipelines used to refuse, at pp=2 against the single process: activation checkpointing
(selective and full) under every schedule, including the zero-bubble W deferral (fp64 gradients
1e-12, and the stash really shrinks), and evaluation through the schedule's forward-only path
(fp64 loss 1e-12)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import own_group
from hpctrain.models import build_model
from hpctrain.models.checkpointing import apply_activation_checkpointing
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.stage import build_local_stages
from hpctrain.parallel.step import lm_loss
from tests.parallel.test_pp_runtime import (
    CASES,
    MB,
    SEED,
    SEQ,
    _micro_batches,
    _model_cfg,
    _reference,
)


def _runtime(name: str, v: int, m: int, *, checkpointing: str = "none"):
    rank = dist.get_rank()
    schedule = build_schedule(name, pp=dist.get_world_size(), microbatches=m, virtual_stages=v)
    cfg = _model_cfg(n_layers=schedule.n_stages)
    local, _ = build_local_stages(cfg, schedule.stages_of(rank), n_stages=schedule.n_stages,
                                  seed=SEED, tp_group=own_group())
    local.double()
    apply_activation_checkpointing(local, checkpointing)
    runtime = PipelineRuntime(lower_comm(schedule), local, pp_rank=rank,
                              peers=list(range(dist.get_world_size())),
                              act_shape=(MB, SEQ, cfg.dim), loss_fn=lm_loss)
    return cfg, local, runtime, schedule.n_stages - 1 in schedule.stages_of(rank)


def _step_saving(runtime, micro) -> int:
    """Run one step; bytes autograd saved outside checkpointed regions (the stash)."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        runtime.step(micro)
    return saved[0]


def checkpointed_matches(name: str, v: int, mode: str, m: int = 4) -> tuple[float, float]:
    """(worst gradient rel. error vs the single process, stash bytes with / without `mode`)."""
    torch.set_default_dtype(torch.float64)
    try:
        _, _, plain, _ = _runtime(name, v, m)
        cfg, local, runtime, _ = _runtime(name, v, m, checkpointing=mode)
        micro = _micro_batches(m, cfg.vocab_size)
        ratio = _step_saving(runtime, micro) / _step_saving(plain, micro)
        _, ref = _reference(cfg, micro)
        names = {n for n, _ in local.named_parameters()}
        assert names <= ref.keys(), sorted(names - ref.keys())  # the full model's names
        worst = 0.0
        for n, p in local.named_parameters():
            assert p.grad is not None, f"{n} has no gradient"
            worst = max(worst, float((p.grad - ref[n]).abs().max() / ref[n].abs().max()))
        return worst, ratio
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("name,v", CASES)
def test_checkpointing_matches_single_process(world2, name, v, mode):
    for worst, ratio in world2.run(checkpointed_matches, name, v, mode):
        assert worst < 1e-12
        assert ratio < (0.5 if mode == "full" else 0.95)  # recomputed, not stashed


def evaluate_matches(name: str, v: int, m: int = 4) -> list[float]:
    """|evaluate(first k microbatches) − Σ single-process loss| for k = m and k = 1."""
    torch.set_default_dtype(torch.float64)
    try:
        cfg, _, runtime, holds = _runtime(name, v, m)
        micro = _micro_batches(m, cfg.vocab_size)
        model = build_model(cfg, seed=SEED).double()
        errors = []
        for k in (m, 1):
            got = runtime.evaluate(micro[:k])
            assert (got is not None) == holds
            with torch.no_grad():
                ref = sum(float(lm_loss(model(x), y)) for x, y in micro[:k])
            errors.append(abs(float(got) - ref) if holds else 0.0)
        assert not any(p.grad is not None for p in runtime.local.parameters())
        return errors
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("name,v", CASES)
def test_evaluate_is_the_forward_path(world2, name, v):
    assert max(max(e) for e in world2.run(evaluate_matches, name, v)) < 1e-12

"""Pipeline runtime numerics: every schedule at pp=2 and pp=4 reproduces the single-process
loss and every parameter gradient (fp64, compared by parameter name)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import own_group
from hpctrain.models.config import ModelConfig
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.stage import build_local_stages
from hpctrain.parallel.step import lm_loss
from tests.references import fp64_grads, micro_batches

SEED, MB, SEQ = 7, 2, 8
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_h2", 1),
         ("zbv", 1)]


def _model_cfg(n_layers: int) -> ModelConfig:
    return ModelConfig(name="debug", vocab_size=64, dim=16, n_layers=n_layers, n_heads=4,
                       n_kv_heads=2, ffn_dim=32, max_seq_len=SEQ, attention="eager")


def _micro_batches(m: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return micro_batches(m, MB, SEQ, vocab=vocab, seed=SEED)


def _reference(cfg: ModelConfig, micro) -> tuple[float, dict[str, torch.Tensor]]:
    return fp64_grads(cfg, micro, seed=SEED, loss_fn=lm_loss)


def run_pipeline_and_compare(name: str, v: int, m: int, drop_w: bool = False) -> float:
    """On each rank: run the schedule, compare its stages' grads with the reference."""
    torch.set_default_dtype(torch.float64)
    try:
        pp, rank = dist.get_world_size(), dist.get_rank()
        schedule = build_schedule(name, pp=pp, microbatches=m, virtual_stages=v)
        cfg = _model_cfg(n_layers=schedule.n_stages)
        if drop_w:
            schedule = _without_first_w(schedule)
        local, _ = build_local_stages(cfg, schedule.stages_of(rank), tp_group=own_group(),
                                      n_stages=schedule.n_stages, seed=SEED)
        local.double()
        runtime = PipelineRuntime(lower_comm(schedule), local, pp_rank=rank,
                                  peers=list(range(pp)), act_shape=(MB, SEQ, cfg.dim),
                                  loss_fn=lm_loss)
        micro = _micro_batches(m, cfg.vocab_size)
        result = runtime.step(micro)
        ref_loss, ref_grads = _reference(cfg, micro)
        holds_last = schedule.n_stages - 1 in schedule.stages_of(rank)
        assert (result.loss_sum is not None) == holds_last
        if holds_last:
            assert abs(float(result.loss_sum) - ref_loss) < 1e-12
        worst = 0.0
        for n, p in local.named_parameters():
            assert p.grad is not None, f"{n} has no gradient"
            err = float((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max())
            worst = max(worst, err)
            assert err < 1e-12, f"{name}: {n} rel. error {err:.2e}"
        return worst
    finally:
        torch.set_default_dtype(torch.float32)


def _without_first_w(schedule):
    """The schedule minus one W action: the deliberate bug the tests must catch."""
    from dataclasses import replace

    from hpctrain.parallel.pipeline.actions import ActionKind

    acts = [list(a) for a in schedule.actions]
    for rank_acts in acts:
        for k, a in enumerate(rank_acts):
            if a.kind is ActionKind.W:
                del rank_acts[k]
                return replace(schedule, actions=tuple(map(tuple, acts)))
    raise AssertionError("schedule has no W action")


@pytest.mark.parametrize("name,v", CASES)
def test_pp2_matches_single_process(world2, name, v):
    assert max(world2.run(run_pipeline_and_compare, name, v, 4)) < 1e-12


@pytest.mark.parametrize("name,v", CASES)
def test_pp4_matches_single_process(world4, name, v):
    assert max(world4.run(run_pipeline_and_compare, name, v, 8)) < 1e-12


def test_dropped_w_is_caught(world2):
    with pytest.raises(AssertionError, match="no gradient|rel. error|incomplete"):
        world2.run(run_pipeline_and_compare, "zb_h1", 1, 4, True)


def _batched_equals_unbatched(schedule: str):
    """The NCCL code path (batched p2p groups) driven over gloo: same loss and gradients."""
    from hpctrain.models import PRESETS

    cfg, rank = PRESETS["debug"], dist.get_rank()
    s = build_schedule(schedule, pp=2, microbatches=4)
    local, _ = build_local_stages(cfg, s.stages_of(rank), n_stages=s.n_stages, seed=0,
                                  tp_group=own_group())
    gen = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 512, (2, 16), generator=gen),
            torch.randint(0, 512, (2, 16), generator=gen)) for _ in range(4)]
    results = []
    for batched in (False, True):
        for p in local.parameters():
            p.grad = None
        rt = PipelineRuntime(lower_comm(s), local, pp_rank=rank, peers=[0, 1],
                             act_shape=(2, 16, cfg.dim), batched=batched,
                             loss_fn=lm_loss)
        res = rt.step(mbs)
        results.append((None if res.loss_sum is None else float(res.loss_sum),
                        [p.grad.clone() for p in local.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    return loss_a == loss_b and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b,
                                                                       strict=True))


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_batched_p2p_path_matches(world2, schedule):
    assert world2.run(_batched_equals_unbatched, schedule, timeout_s=60) == [True, True]

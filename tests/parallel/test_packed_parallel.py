"""Packed documents under every parallel axis: tp=2 (with sp), pp=2 and dp=2 give the loss and
every gradient slice of the single-process model on the same packed, padded micro-batches
(fp64, 1e-12). That reference equals each document run alone (tests/unit/test_packed_model.py),
so the parallel runs do too. The documents travel in the micro-batch (ops.documents), which
every tp rank and every pipeline stage of a replica reads.

The reference is one process computing one mean over every real token of the whole global
batch, concatenated: the micro-batches hold very different numbers of real tokens, so a mean of
per-micro-batch means (the old scaling) fails these tests; the runs weight each micro-batch by
its real tokens (parallel.step.loss_divisors), in the runtime and in the engine's train_step."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh
from hpctrain.models import build_model
from hpctrain.models.config import ModelConfig
from hpctrain.ops.documents import IGNORE_INDEX, Documents
from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.stage import build_local_stages
from hpctrain.parallel.pipeline.tp_stages import stage_act_shape
from hpctrain.parallel.scaler import LossScaler
from hpctrain.parallel.state import norm_spec, placements
from hpctrain.parallel.step import allreduce_mean, eval_loss, lm_loss, loss_divisors
from hpctrain.parallel.tensor import (
    apply_tensor_parallel,
    sync_tp_grads,
    vocab_parallel_cross_entropy,
)
from hpctrain.train.tensor_parallel import step_loss, tp_pre_reduce
from tests import references
from tests.parallel.dp_helpers import OPTIM
from tests.parallel.threed_reference import expected_slice

SEED, MB, SEQ, M = 11, 2, 12, 2
TOL = 1e-12


def _cfg(attention: str = "sdpa") -> ModelConfig:
    return ModelConfig(name="debug", vocab_size=64, dim=16, n_layers=4, n_heads=4, n_kv_heads=2,
                       ffn_dim=32, max_seq_len=SEQ, attention=attention)


def packed_micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, Documents]]:
    return references.packed_micro_batches(n, MB, SEQ, vocab=64, seed=SEED)


def reference(cfg: ModelConfig, micro):
    return references.fp64_packed_grads(cfg, micro, seed=SEED)


_ce64 = references.ce64


def _compare(grads, mesh, cfg, micro, losses) -> dict[str, float]:
    """|run − reference| of each of `losses` (name → dp-mean loss, None: not held here) and of
    each gradient (complete over tp, averaged over dp) against this rank's reference slice."""
    ref_loss, ref_grads = reference(cfg, micro)
    errs = {k: abs(float(v) - ref_loss) for k, v in losses.items() if v is not None}
    tp, tp_rank = mesh.dims.tp, mesh.coord("tp")
    for n, g in grads.items():
        want = expected_slice(n, ref_grads[n], cfg, tp=tp, tp_rank=tp_rank)
        errs[n] = float((g - want).abs().max())
    return errs


def _errors(named, mesh, cfg, micro, loss, *, plan) -> dict[str, float]:
    params = [p for _, p in named]
    if plan is not None:
        sync_tp_grads(params, plan)
    allreduce_mean([p.grad for p in params], mesh.group("dp"))
    if loss is not None:  # as the engine reports it: the dp mean of the weighted sums
        loss = loss.reshape(1).clone()
        allreduce_mean([loss], mesh.group("dp"))
    return _compare({n: p.grad for n, p in named}, mesh, cfg, micro, {"loss": loss})


def _mine(mesh, micro) -> list:
    d = mesh.coord("dp")
    return micro[d * M:(d + 1) * M]


def _divisors(mesh, mine) -> list[float]:
    return loss_divisors(mine, dp_group=mesh.group("dp"), device=torch.device("cpu"))


def run_pipeline(dp: int, tp: int, pp: int, *, sp: bool, attention: str = "sdpa"
                 ) -> dict[str, float]:
    """This replica's M micro-batches through the 1f1b pipeline on (tp-sharded) stages."""
    torch.set_default_dtype(torch.float64)
    try:
        dims, cfg = ParallelDims(dp=dp, tp=tp, pp=pp), _cfg(attention)
        mesh = build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu"))
        schedule = build_schedule("1f1b", pp=pp, microbatches=M, virtual_stages=1)
        local, plan = build_local_stages(cfg, schedule.stages_of(mesh.coord("pp")),
                                         n_stages=schedule.n_stages, seed=SEED,
                                         tp_group=mesh.group("tp"), sp=sp)
        local.double()
        runtime = PipelineRuntime(lower_comm(schedule), local, pp_rank=mesh.coord("pp"),
                                  peers=dims.group_ranks("pp", mesh.rank),
                                  act_shape=stage_act_shape(micro_batch=MB, seq_len=SEQ,
                                                            dim=cfg.dim, tp=tp, sp=sp),
                                  # fp64 at tp = 1 (lm_loss casts to fp32)
                                  loss_fn=step_loss(plan) if plan is not None else _ce64)
        micro = packed_micro_batches(dp * M)
        mine = _mine(mesh, micro)
        result = runtime.step(mine, divisors=_divisors(mesh, mine))
        return _errors(list(local.named_parameters()), mesh, cfg, micro, result.loss_sum,
                       plan=plan)
    finally:
        torch.set_default_dtype(torch.float32)


def run_tensor_data(dp: int, tp: int, *, sp: bool) -> dict[str, float]:
    """The whole model, tp-sharded (vocab-parallel loss, which skips the padding), over dp."""
    torch.set_default_dtype(torch.float64)
    try:
        dims, cfg = ParallelDims(dp=dp, tp=tp), _cfg()
        mesh = build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu"))
        model = build_model(cfg, seed=SEED).double()
        plan = apply_tensor_parallel(model, group=mesh.group("tp"), sp=sp, seed=SEED, cfg=cfg)
        micro = packed_micro_batches(dp * M)
        mine, loss = _mine(mesh, micro), torch.zeros((), dtype=torch.float64)
        for (inputs, targets, docs), divisor in zip(mine, _divisors(mesh, mine), strict=True):
            logits = model(inputs, docs=docs)
            part = vocab_parallel_cross_entropy(logits, targets, group=plan.group) / divisor
            part.backward()
            loss += part.detach()
        return _errors(list(model.named_parameters()), mesh, cfg, micro, loss, plan=plan)
    finally:
        torch.set_default_dtype(torch.float32)


def run_engine(dp: int, tp: int, *, sp: bool) -> dict[str, float]:
    """The data-parallel engine's own train_step over dp × M accumulated micro-batches (the
    whole model, tp-sharded with the vocab-parallel loss when tp > 1), and eval_loss on the
    same batch: the step's reported loss, the gradients its update uses (read as the optimizer
    starts) and the eval loss, each against the reference."""
    torch.set_default_dtype(torch.float64)
    try:
        dims, cfg = ParallelDims(dp=dp, tp=tp), _cfg()
        mesh = build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu"))
        model = build_model(cfg, seed=SEED).double()
        plan, loss_fn = None, _ce64
        if tp > 1:
            plan = apply_tensor_parallel(model, group=mesh.group("tp"), sp=sp, seed=SEED, cfg=cfg)
            loss_fn = functools.partial(vocab_parallel_cross_entropy, group=plan.group)
        engine = DataParallel(model, group=mesh.group("dp"), batch_group=mesh.group("dp"),
                              zero=0, precision="fp32",
                              optim=OPTIM, bucket_mb=0.001,
                              norm=norm_spec(placements(model, tp_plan=plan, stages=None,
                                                        tied=None), mesh),
                              pre_reduce=tp_pre_reduce(model, plan))
        micro = packed_micro_batches(dp * M)
        mine = _mine(mesh, micro)
        evaluated = eval_loss(model, mine, precision="fp32", dp_group=mesh.group("dp"),
                              loss_fn=loss_fn)
        grads, update = {}, engine.optimizer.step

        def spy(**kw):  # the reduced gradients, before the update zeroes them
            grads.update({n: u._view(u.grad_full, i).clone()
                          for u in engine.units for i, n in enumerate(u.names)})
            return update(**kw)

        engine.optimizer.step = spy
        result = engine.train_step(mine, n_micro=M, precision="fp32", grad_clip=0.0,
                                   scaler=LossScaler(enabled=False), loss_fn=loss_fn)
        return _compare(grads, mesh, cfg, micro, {"loss": result.loss, "eval": evaluated})
    finally:
        torch.set_default_dtype(torch.float32)


def _check(results: list[dict[str, float]]) -> None:
    for rank, errs in enumerate(results):
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOL, (rank, worst, errs[worst])


def test_pp2_tp2_sp_packed_matches_single_process(world4):
    results = world4.run(run_pipeline, 1, 2, 2, sp=True)
    assert sum("loss" in e for e in results) == 2  # the last stage's tp ranks
    _check(results)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_pp2_dp2_packed_matches_single_process(world4, attention):
    _check(world4.run(run_pipeline, 2, 1, 2, sp=False, attention=attention))


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_dp2_packed_matches_single_process(world4, sp):
    _check(world4.run(run_tensor_data, 2, 2, sp=sp))


@pytest.mark.parametrize("dp,tp", [(4, 1), (2, 2)])
def test_engine_step_and_eval_weight_real_tokens(world4, dp, tp):
    results = world4.run(run_engine, dp, tp, sp=tp > 1)
    assert all({"loss", "eval"} <= set(e) for e in results)
    _check(results)


def test_divisors_without_padding_are_the_microbatch_count():
    """No padding: d_i = m exactly (the old mean of means, bit for bit); with padding the
    divisors weight by real tokens; an all-padding micro-batch adds a zero loss; a global
    batch with no real token is refused, naming the fix."""
    cpu = torch.device("cpu")
    x = torch.zeros(2, 5, dtype=torch.long)
    assert loss_divisors([(x, x)] * 3, dp_group=None, device=cpu) == [3.0] * 3
    padded = x.clone()
    padded[0, 1:] = IGNORE_INDEX  # 6 real tokens of 10
    got = loss_divisors([(x, x), (x, padded)], dp_group=None, device=cpu)
    assert got == [16 / 10, 16 / 6]
    empty = torch.full_like(x, IGNORE_INDEX)
    assert loss_divisors([(x, x), (x, empty)], dp_group=None, device=cpu) == [1.0, 1.0]
    logits = torch.randn(2, 5, 7, requires_grad=True)
    zero = lm_loss(logits, empty)
    zero.backward()
    assert float(zero) == 0.0 and float(logits.grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="no real token.*give the batch real"):
        loss_divisors([(x, empty)], dp_group=None, device=cpu)

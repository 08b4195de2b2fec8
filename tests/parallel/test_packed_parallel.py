"""Packed documents under every parallel axis: tp=2 (with sp), pp=2 and dp=2 give the loss and
every gradient slice of the single-process model on the same packed, padded micro-batches
(fp64, 1e-12). That reference equals each document run alone (tests/unit/test_packed_model.py),
so the parallel runs do too. The documents travel in the micro-batch (ops.documents), which
every tp rank and every pipeline stage of a replica reads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh
from hpctrain.models import build_model
from hpctrain.models.config import ModelConfig
from hpctrain.ops.documents import IGNORE_INDEX, Documents
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.stage import build_local_stages
from hpctrain.parallel.pipeline.tp_stages import stage_act_shape
from hpctrain.parallel.step import allreduce_mean, lm_loss
from hpctrain.parallel.tensor import (
    apply_tensor_parallel,
    sync_tp_grads,
    vocab_parallel_cross_entropy,
)
from tests.parallel.threed_reference import expected_slice

SEED, MB, SEQ, M = 11, 2, 12, 2
TOL = 1e-12


def _cfg(attention: str = "sdpa") -> ModelConfig:
    return ModelConfig(name="debug", vocab_size=64, dim=16, n_layers=4, n_heads=4, n_kv_heads=2,
                       ffn_dim=32, max_seq_len=SEQ, attention=attention)


def packed_micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, Documents]]:
    """n micro-batches of MB rows, each row several documents (one of length 1) and padding."""
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(n):
        seq = torch.randint(0, 64, (MB, SEQ + 1), generator=gen)
        inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
        ids = torch.empty(MB, SEQ, dtype=torch.long)
        for b in range(MB):
            cuts = sorted(torch.randperm(SEQ - 2, generator=gen)[:3].add(1).tolist())
            ids[b] = torch.bucketize(torch.arange(SEQ), torch.tensor(cuts), right=True)
        pad = int(torch.randint(0, 4, (), generator=gen))
        targets[0, SEQ - pad:] = IGNORE_INDEX
        ids[0, SEQ - pad:] = ids[0, SEQ - pad - 1] + 1
        out.append((inputs, targets, Documents.from_ids(ids)))
    return out


def reference(cfg: ModelConfig, micro, *, loss_fn):
    """(mean loss, gradients by name) of the single-process model over all micro-batches."""
    model = build_model(cfg, seed=SEED).double()
    total = 0.0
    for inputs, targets, docs in micro:
        loss = loss_fn(model(inputs, docs=docs), targets) / len(micro)
        loss.backward()
        total += float(loss)
    return total, {n: p.grad for n, p in model.named_parameters()}


def _ce64(logits_BLV, targets_BL):
    return F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL.flatten())


def _errors(named, mesh, cfg, micro, loss, *, plan) -> dict[str, float]:
    params = [p for _, p in named]
    if plan is not None:
        sync_tp_grads(params, plan)
    allreduce_mean([p.grad for p in params], mesh.group("dp"))
    # The same loss as the run: lm_loss (fp32, as the trainer) on one tp rank, fp64 under tp.
    ref_loss, ref_grads = reference(cfg, micro, loss_fn=lm_loss if plan is None else _ce64)
    errs = {}
    if loss is not None:
        loss = loss.reshape(1).clone()
        allreduce_mean([loss], mesh.group("dp"))
        errs["loss"] = abs(float(loss) - ref_loss)
    tp, tp_rank = mesh.dims.tp, mesh.coord("tp")
    for n, p in named:
        want = expected_slice(n, ref_grads[n], cfg, tp=tp, tp_rank=tp_rank)
        errs[n] = float((p.grad - want).abs().max())
    return errs


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
                                                            dim=cfg.dim, tp=tp, sp=sp))
        micro = packed_micro_batches(dp * M)
        d = mesh.coord("dp")
        result = runtime.step(micro[d * M:(d + 1) * M])
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
        d, loss = mesh.coord("dp"), torch.zeros((), dtype=torch.float64)
        for inputs, targets, docs in micro[d * M:(d + 1) * M]:
            logits = model(inputs, docs=docs)
            part = vocab_parallel_cross_entropy(logits, targets, group=plan.group) / M
            part.backward()
            loss += part.detach()
        return _errors(list(model.named_parameters()), mesh, cfg, micro, loss, plan=plan)
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

"""tp inside pipeline stages (3D): the pipeline runtime on tensor-parallel stages reproduces
the single-process loss, every gradient slice and the global grad norm (fp64, 1e-12) for
pp=2 × tp=2 (4 ranks, with and without sp) and dp=2 × tp=2 × pp=2 (8 ranks)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh
from hpctrain.parallel.pipeline.hop import Hop, stage_hop
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.stage import build_local_stages
from hpctrain.parallel.pipeline.tp_stages import stage_act_shape
from hpctrain.parallel.step import allreduce_mean
from hpctrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear, sync_tp_grads
from hpctrain.tasks.dryrun.comm import CommTally
from hpctrain.train.tensor_parallel import step_loss
from tests.parallel.threed_reference import (
    MB,
    SEED,
    SEQ,
    expected_slice,
    micro_batches,
    model_cfg,
    reference,
)

TOL = 1e-12
TP_LAYERS = (ColumnParallelLinear, RowParallelLinear)


def _build(dims: ParallelDims, name: str, m: int, *, sp: bool, kv: int):
    mesh = build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu"))
    schedule = build_schedule(name, pp=dims.pp, microbatches=m, virtual_stages=1)
    cfg = model_cfg(n_layers=2 * schedule.n_stages, n_kv_heads=kv)
    local, plan = build_local_stages(cfg, schedule.stages_of(mesh.coord("pp")),
                                     n_stages=schedule.n_stages, seed=SEED,
                                     tp_group=mesh.group("tp"), sp=sp)
    local.double()
    runtime = PipelineRuntime(lower_comm(schedule), local, pp_rank=mesh.coord("pp"),
                              peers=dims.group_ranks("pp", mesh.rank),
                              act_shape=stage_act_shape(micro_batch=MB, seq_len=SEQ,
                                                        dim=cfg.dim, tp=dims.tp, sp=sp),
                              loss_fn=step_loss(plan), hop=stage_hop(mesh, sp=sp))
    return mesh, schedule, cfg, local, plan, runtime


def run_3d_and_compare(dp: int, tp: int, pp: int, name: str, *, sp: bool = False, kv: int = 2,
                       m: int = 4) -> dict[str, float]:
    """On each rank: one step of this replica's m micro-batches, grads synced over tp and
    averaged over dp; errors against the reference on all dp·m micro-batches."""
    torch.set_default_dtype(torch.float64)
    try:
        dims = ParallelDims(dp=dp, tp=tp, pp=pp)
        mesh, schedule, cfg, local, plan, runtime = _build(dims, name, m, sp=sp, kv=kv)
        _assert_queues_attached(local)
        micro = micro_batches(dp * m, cfg.vocab_size)
        dp_rank = mesh.coord("dp")
        with CommTally(mesh) as tally:
            result = runtime.step(micro[dp_rank * m:(dp_rank + 1) * m])
        _assert_hops(tally, runtime, m=m, tp=tp, sp=sp)
        params = list(local.parameters())
        sync_tp_grads(params, plan)
        allreduce_mean([p.grad for p in params], mesh.group("dp"))
        ref_loss, ref_grads, ref_norm = reference(cfg, micro)
        errs = {}
        if result.loss_sum is not None:
            loss = result.loss_sum.reshape(1)
            allreduce_mean([loss], mesh.group("dp"))
            errs["loss"] = abs(float(loss) - ref_loss)
        for n, p in local.named_parameters():
            want = expected_slice(n, ref_grads[n], cfg, tp=tp, tp_rank=mesh.coord("tp"))
            assert p.grad.shape == want.shape, (n, p.grad.shape, want.shape)
            errs[n] = float((p.grad - want).abs().max() / want.abs().max())
        norm = _global_norm(params, mesh=mesh, replicas=plan.replicas)
        errs["grad_norm"] = abs(norm - ref_norm) / ref_norm
        return errs
    finally:
        torch.set_default_dtype(torch.float32)


def _assert_hops(tally: CommTally, runtime, *, m: int, tp: int, sp: bool) -> None:
    """Each of the m activations or gradients crossing this rank's stage boundary leaves it as
    a 1/tp piece (Megatron's scatter/gather; sp: the sequence shard), and without sp each one
    received is all-gathered over tp."""
    whole = MB * SEQ * runtime.act_shape[-1] * 8  # fp64
    world = tally.groups["world"]
    assert world.ops == {"send": m, "recv_": m}, world.ops
    assert world.bytes["send"] == m * whole / tp
    if not sp:  # the only all-gathers of a tp stage without sp: one per message received
        tp_ops = next(v.ops for k, v in tally.groups.items() if "tp" in k.split("="))
        assert tp_ops["_allgather_base_"] == m, tp_ops


def _global_norm(params, *, mesh, replicas: dict[int, int]) -> float:
    """‖g‖ of the unsharded model from this rank's stage shards: Σ ‖g_p‖² / replicas(p) over
    tp and pp (the trainer's own norm, the engine's, is checked by the 3D trainer tests)."""
    sq = torch.stack([p.grad.double().pow(2).sum() / replicas.get(id(p), 1)
                      for p in params]).sum()
    for axis in ("tp", "pp"):
        if mesh.group(axis) is not None:
            dist.all_reduce(sq, group=mesh.group(axis))
    return float(sq.sqrt())


def _assert_queues_attached(local) -> None:
    """Zero-bubble W deferral goes through the tp layers: each holds its stage's queue."""
    for stage in local.stages.values():
        tp_layers = [m for m in stage.module.modules() if isinstance(m, TP_LAYERS)]
        assert tp_layers and all(m.wgrad_queue is stage.wgrad_queue for m in tp_layers)


def _check(results: list[dict[str, float]]) -> None:
    assert sum("loss" in errs for errs in results) == len(results) // 2  # last-stage ranks
    for rank, errs in enumerate(results):
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOL, (rank, worst, errs[worst])


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "gpipe", "zb_h2"])
@pytest.mark.parametrize("sp", [False, True])
def test_pp2_tp2_matches_single_process(world4, name, sp):
    _check(world4.run(run_3d_and_compare, 1, 2, 2, name, sp=sp))


def test_pp2_tp2_replicated_kv_head(world4):
    """One kv head replicated on both tp ranks: its gradient is summed across them."""
    _check(world4.run(run_3d_and_compare, 1, 2, 2, "zb_h1", kv=1))


@pytest.mark.parametrize("name", ["1f1b", "zb_h1"])
def test_3d_dp2_tp2_pp2_matches_single_process(world8, name):
    _check(world8.run(run_3d_and_compare, 2, 2, 2, name, sp=name == "zb_h1"))


def scatter_and_gather(shape: tuple[int, ...]) -> tuple[list[int], bool]:
    """Every rank holds the same tensor of `shape`, sends its piece (kept here) and gathers
    them all back: (the piece's shape, whether the gathered tensor is the original)."""
    torch.manual_seed(0)
    x = torch.randn(shape)
    group = dist.new_group(list(range(dist.get_world_size())))
    hop = Hop(group, rank=dist.get_rank(), size=dist.get_world_size())
    piece = hop.outgoing(x).clone()
    back = hop.incoming(piece, shape)
    return list(piece.shape), back.shape == x.shape and torch.equal(back, x)


@pytest.mark.parametrize("shape", [(2, 8, 16), (3, 5)])
def test_a_hop_scattered_over_tp_is_gathered_back_bit_for_bit(world2, shape):
    """Pieces of ⌈numel/t⌉ elements, the last zero-padded when numel is odd."""
    for piece, same in world2.run(scatter_and_gather, shape):
        assert piece == [-(-math.prod(shape) // 2)] and same

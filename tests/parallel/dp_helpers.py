"""Rank-side functions for the data-parallel / ZeRO tests (module-level: they are pickled).

The reference is the plain single-process step (torch AdamW, one global batch) built from
the same seed on every rank; the dp run feeds each rank its slice of the same global batch.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hpctrain.config.schema import OptimConfig
from hpctrain.models import PRESETS, build_model
from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.data.zero import NormSpec
from hpctrain.parallel.scaler import LossScaler
from tests.references import reference_run, token_batch

# eps ≫ gradient rounding noise: Adam divides by |g| + eps, so with eps=1e-8 the ulp-level
# differences of tiny gradients (summed in another order) are amplified to O(lr).
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, eps=1e-4)
SEQ, MICRO = 16, 2  # tokens per sample, samples per micro-batch per rank


def global_batch(step: int, *, dp: int, accum: int, vocab: int):
    return token_batch(dp * accum * MICRO, SEQ, vocab=vocab, seed=1000 + step)


def rank_micro_batches(step: int, *, dp: int, rank: int, accum: int, vocab: int):
    x, y = global_batch(step, dp=dp, accum=accum, vocab=vocab)
    x, y = x.view(accum, dp, MICRO, SEQ), y.view(accum, dp, MICRO, SEQ)
    return [(x[m, rank], y[m, rank]) for m in range(accum)]


def reference(steps: int, *, dp: int, accum: int, dtype=torch.float32, grad_clip=1.0):
    """Single process, the whole global batch split into dp·accum micro-batches."""
    model = build_model(PRESETS["debug"], seed=0).to(dtype)
    vocab, n = PRESETS["debug"].vocab_size, dp * accum

    def batches(step: int):
        x, y = global_batch(step, dp=dp, accum=accum, vocab=vocab)
        return list(zip(x.view(n, MICRO, SEQ).unbind(0), y.view(n, MICRO, SEQ).unbind(0),
                        strict=True))

    return reference_run(model, OPTIM, steps, batches, grad_clip=grad_clip)[0]


def make_engine(*, zero: int, precision="fp32", dtype=torch.float32, bucket_mb=0.01,
                comm="fp32", offload="none", group=None, replicate: int = 1):
    """The debug model in a dp engine over the world (or `group`); `replicate` > 1: HSDP,
    sharded over world / replicate consecutive ranks and all-reduced over the replicas."""
    model = build_model(PRESETS["debug"], seed=0).to(dtype)
    groups = {"group": group or dist.group.WORLD, "batch_group": group or dist.group.WORLD}
    if replicate > 1:
        mesh = _mesh(replicate)
        groups = {"group": mesh.shard, "replicas": mesh.replicate, "batch_group": mesh.dp_cp}
    engine = DataParallel(model, zero=zero, precision=precision, optim=OPTIM,
                          bucket_mb=bucket_mb, grad_comm_dtype=comm, offload=offload,
                          norm=NormSpec(), **groups)
    return model, engine


def _mesh(replicate: int = 1):
    from hpctrain.distributed.dims import ParallelDims
    from hpctrain.distributed.mesh import build_mesh

    dims = ParallelDims(dp=dist.get_world_size(), dp_replicate=replicate)
    return build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu"))


def dp_state(model, engine):
    """The ParallelState of a dp-only world (dp = world size) around `engine`."""
    from hpctrain.parallel.state import parallel_state, placements

    placed = placements(model, tp_plan=None, stages=None, tied=None)
    return parallel_state(model, placed, mesh=_mesh(), engine=engine)


def full_params(engine) -> dict[str, torch.Tensor]:
    """Full fp32 (master) values by FQN, gathered from the shards."""
    from hpctrain.parallel.data.state import full_model_state

    return full_model_state(engine)


def run_dp(steps: int, *, zero: int, accum: int, precision="fp32", dtype=torch.float32,
           comm="fp32", offload="none", grad_clip=1.0, replicate: int = 1):
    dp, rank = dist.get_world_size(), dist.get_rank()
    model, engine = make_engine(zero=zero, precision=precision, dtype=dtype, comm=comm,
                                offload=offload, replicate=replicate)
    vocab = PRESETS["debug"].vocab_size
    losses = []
    for step in range(steps):
        mbs = rank_micro_batches(step, dp=dp, rank=rank, accum=accum, vocab=vocab)
        losses.append(engine.train_step(mbs, n_micro=accum, precision=precision,
                                        scaler=LossScaler(enabled=False), grad_clip=grad_clip).loss)
    return full_params(engine), losses


def compare_with_reference(steps: int, *, zero: int, accum: int, dtype=torch.float32,
                           replicate: int = 1, grad_clip: float = 1.0):
    got, _ = run_dp(steps, zero=zero, accum=accum, dtype=dtype, replicate=replicate,
                    grad_clip=grad_clip)
    ref = reference(steps, dp=dist.get_world_size(), accum=accum, dtype=dtype,
                    grad_clip=grad_clip)
    return max(float((got[n].to(dtype) - ref[n]).abs().max()) for n in ref)


def hsdp_shards(zero: int, *, replicate: int = 2) -> tuple[int, int, int]:
    """After one HSDP step: (elements of this rank's optimizer shards, elements of the model,
    0 if the master shards equal those of the rank `world / replicate` apart, else 1)."""
    model, engine = make_engine(zero=zero, replicate=replicate, dtype=torch.float64)
    mbs = rank_micro_batches(0, dp=dist.get_world_size(), rank=dist.get_rank(), accum=1,
                             vocab=PRESETS["debug"].vocab_size)
    engine.train_step(mbs, n_micro=1, precision="fp32", scaler=LossScaler(enabled=False),
                      grad_clip=0.05)
    flat = torch.cat([engine.optimizer.state[u.index]["master"] for u in engine.units])
    others = [torch.empty_like(flat) for _ in range(replicate)]
    dist.all_gather(others, flat, group=engine.replicas)
    same = all(torch.equal(o, flat) for o in others)
    return flat.numel(), sum(u.layout.numel for u in engine.units), 0 if same else 1


def overlap_times():
    """(issue times of each bucket's collective, time backward returned)."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    model, engine = make_engine(zero=0, bucket_mb=0.02)
    x, y = rank_micro_batches(0, dp=dp, rank=rank, accum=1, vocab=512)[0]
    from hpctrain.parallel.step import lm_loss

    loss = lm_loss(model(x), y)
    loss.backward()
    t_end = time.perf_counter()
    engine.reducer.finish()
    return [t for _, t in engine.reducer.issue_times], t_end, len(engine.units)


def replica_overlap_times(zero: int):
    """HSDP 2 × 2: (issue times of the units' replica all-reduces, time backward returned,
    units) of one micro-batch whose reduction runs inside backward."""
    from hpctrain.parallel.step import lm_loss

    model, engine = make_engine(zero=zero, replicate=2, bucket_mb=0.02, dtype=torch.float64)
    x, y = rank_micro_batches(0, dp=dist.get_world_size(), rank=dist.get_rank(), accum=1,
                              vocab=512)[0]
    lm_loss(model(x), y).backward()
    t_end = time.perf_counter()
    engine.reducer.finish()
    return [t for _, t in engine.reducer.replica_times], t_end, len(engine.units)


def works_held_after_backward(zero: int) -> tuple[int, int]:
    """(reductions still holding their packed gradient buffer — through their Work, or as
    the buffer reduced in place (gloo's all-reduce) — when backward returns, units) of one
    micro-batch with the reduction inside backward."""
    from hpctrain.parallel.step import lm_loss

    model, engine = make_engine(zero=zero, bucket_mb=0.02)
    x, y = rank_micro_batches(0, dp=dist.get_world_size(), rank=dist.get_rank(), accum=1,
                              vocab=512)[0]
    lm_loss(model(x), y).backward()
    held = sum(p.work is not None or p.buf is not None for p in engine.reducer._pending)
    engine.reducer.finish()
    return held, len(engine.units)


def ledger_and_padding(zero: int):
    """After one bf16 step: (ledger, Ψ, padding elements of this rank's layout)."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    model, engine = make_engine(zero=zero, precision="bf16", bucket_mb=0.05)
    mbs = rank_micro_batches(0, dp=dp, rank=rank, accum=1, vocab=512)
    engine.train_step(mbs, n_micro=1, precision="bf16", scaler=LossScaler(enabled=False),
                      grad_clip=1.0)
    psi = sum(u.layout.numel for u in engine.units)
    peak = None
    if engine.zero3 is not None:
        z = engine.zero3
        blocks = sorted((u.layout.padded_numel * 2 for u in engine.units[1:]), reverse=True)
        bound = z.shard_bytes + engine.units[0].layout.padded_numel * 2 + sum(blocks[:2])
        peak = (z.peak_bytes, z.shard_bytes, bound)
    return engine.ledger(), psi, engine.padding(), peak


def grad_shard_bytes_through_a_step(zero: int) -> tuple[int, int, int]:
    """Bytes the units' grad shards hold (storage) before a step, between its reduction and
    its update (captured in the optimizer's norm), and after it."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    _, engine = make_engine(zero=zero, precision="bf16", bucket_mb=0.05)
    mbs = rank_micro_batches(0, dp=dp, rank=rank, accum=2, vocab=512)

    def held() -> int:
        return sum(u.grad_shard.untyped_storage().nbytes() for u in engine.units)

    seen = []
    norm = engine.optimizer.global_grad_norm

    def spy(**kw):
        seen.append(held())
        return norm(**kw)

    engine.optimizer.global_grad_norm = spy
    before = held()
    engine.train_step(mbs, n_micro=2, precision="bf16", scaler=LossScaler(enabled=False),
                      grad_clip=1.0)
    return before, seen[0], held()


def trajectory(steps: int, *, precision: str, comm: str = "fp32", zero: int = 2):
    """(max |θ − θ_fp32| of the fp32 masters, max |loss − loss_fp32|) after `steps`."""
    params, ref_losses = run_dp(steps, zero=zero, accum=1, precision="fp32")
    got, losses = run_dp(steps, zero=zero, accum=1, precision=precision, comm=comm)
    return (max(float((got[n] - params[n]).abs().max()) for n in params),
            max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)))


def save_then_continue(path: str, *, zero: int, accum: int):
    """Train 2 steps, save, train 1 more: (loss of step 3, params after it)."""
    from hpctrain.checkpoint import save_load as ckpt

    dp, rank = dist.get_world_size(), dist.get_rank()
    model, engine = make_engine(zero=zero, dtype=torch.float64)
    for step in range(3):
        if step == 2:
            ckpt.save(ckpt.checkpoint_dir(path, 2), parallel=dp_state(model, engine),
                      train_state={"step": 2}, rank_state={})
        mbs = rank_micro_batches(step, dp=dp, rank=rank, accum=accum, vocab=512)
        loss = engine.train_step(mbs, n_micro=accum, precision="fp32",
                                 scaler=LossScaler(enabled=False), grad_clip=1.0).loss
    return loss, full_params(engine)


def load_and_continue(path: str, *, zero: int, accum: int):
    from hpctrain.checkpoint import save_load as ckpt

    dp, rank = dist.get_world_size(), dist.get_rank()
    model, engine = make_engine(zero=zero, dtype=torch.float64)
    state, _ = ckpt.load(ckpt.checkpoint_dir(path, 2), parallel=dp_state(model, engine))
    mbs = rank_micro_batches(state["step"], dp=dp, rank=rank, accum=accum, vocab=512)
    loss = engine.train_step(mbs, n_micro=accum, precision="fp32",
                             scaler=LossScaler(enabled=False), grad_clip=1.0).loss
    return loss, full_params(engine)

"""Rank-side functions of the context-parallel tests (module level: pickled by reference)."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.models import ModelConfig, build_model
from hpctrain.models.checkpointing import apply_activation_checkpointing
from hpctrain.models.config import MoEConfig
from hpctrain.models.moe.layer import take_router_loss
from hpctrain.ops.documents import IGNORE_INDEX, Documents
from hpctrain.parallel.context.apply import apply_context_parallel
from hpctrain.parallel.context.ring import RingComm, block_mask, ring_bytes
from hpctrain.parallel.context.shard import shard_documents, shard_micro_batch
from hpctrain.parallel.step import loss_divisors
from tests.references import token_batch

TIMEOUT = datetime.timedelta(seconds=60)


def tiny_cfg(attention: str, *, n_layers: int = 2, heads: tuple[int, int] = (4, 2),
             experts: int = 0) -> ModelConfig:
    """`experts` > 0: routed experts (top 2, every block) with large router-loss coefficients,
    so an error in their gradients shows."""
    moe = MoEConfig(num_experts=experts, top_k=2, expert_ffn_dim=16, aux_loss_coef=0.5,
                    z_loss_coef=0.1)
    return ModelConfig(name="cp", vocab_size=64, dim=32, n_layers=n_layers, n_heads=heads[0],
                       n_kv_heads=heads[1], ffn_dim=64, max_seq_len=64, attention=attention,
                       moe=moe)


def interpret_triton() -> None:
    """Fail fast unless this rank's Triton kernels can run under the CPU interpreter. A
    process fixes the mode when it first imports triton; ranks inherit TRITON_INTERPRET=1 from
    the test process (tests/conftest.py, on machines without CUDA)."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError("this rank imported triton without TRITON_INTERPRET=1: start the "
                           "world from a process that has it set (tests/conftest.py does)")
    os.environ["TRITON_INTERPRET"] = "1"


def batch(L: int, *, documents: bool):
    inputs_BL, targets_BL = token_batch(2, L, vocab=64, seed=7)
    docs = None
    if documents:  # documents of uneven lengths, one crossing every chunk boundary
        ids_BL = torch.zeros(2, L, dtype=torch.long)
        for b, cuts in enumerate(((3, 11, 12, 29), (L // 2 + 1,))):
            for c in cuts:
                ids_BL[b, c:] += 1
        docs = Documents.from_ids(ids_BL)
    targets_BL = targets_BL.clone()
    if documents:  # padding, unevenly over the shards: the loss must still be the rows' mean
        targets_BL[0, L - 12:] = IGNORE_INDEX
    return inputs_BL, targets_BL, docs


def ce64(logits_BLV, targets_BL):
    """Mean cross entropy over real targets in the logits' dtype, 0 for an all-padding shard
    (as lm_loss, which computes in fp32)."""
    real = (targets_BL != IGNORE_INDEX).sum().clamp(min=1)
    return F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL.flatten(), reduction="sum") / real


def cp_equals_single(attention: str, documents: bool, L: int = 32,
                     transport: str = "ring", *, checkpointing: str = "none",
                     reference: str | None = None, **shape) -> dict:
    """fp64: the loss and every gradient of the model under cp (the world as one cp group,
    activation `checkpointing` on it) against the single process (its attention `reference`,
    default the same backend; `shape`: tiny_cfg's n_layers, heads); returns the largest
    differences, the blocks computed and the bytes sent."""
    torch.set_default_dtype(torch.float64)
    try:
        cfg = tiny_cfg(attention, **shape)
        ref = build_model(tiny_cfg(reference or attention, **shape), seed=3).double()
        inputs_BL, targets_BL, docs = batch(L, documents=documents)
        logits = ref(inputs_BL, docs=docs)
        loss_ref = ce64(logits, targets_BL) + _router(ref)
        loss_ref.backward()
        comm = RingComm(dist.group.WORLD, timeout=TIMEOUT, backend=attention)
        model = build_model(cfg, seed=3).double()
        model.load_state_dict(ref.state_dict())
        apply_context_parallel(model, comm, token_group=comm.group, transport=transport)
        apply_activation_checkpointing(model, checkpointing)
        model.zero_grad(set_to_none=True)
        inp, tgt, sdocs = shard_micro_batch(inputs_BL, targets_BL, docs, rank=comm.rank,
                                            cp=comm.size)
        out = model(inp, docs=sdocs)
        # the engine's view: each shard's mean loss weighted by its real tokens
        # (loss_divisors over the cp group), losses and gradients averaged over cp
        (d,) = loss_divisors([(inp, tgt)], dp_group=dist.group.WORLD, device=torch.device("cpu"))
        loss = (ce64(out, tgt) + _router(model)) / d
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        total /= comm.size
        grad_err = 0.0
        for (_, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(),
                                         strict=True):
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= comm.size
            grad_err = max(grad_err, float((g - p_ref.grad).abs().max()))
        return {"loss_err": abs(float(total - loss_ref)), "grad_err": grad_err,
                "blocks": comm.blocks, "bytes": comm.bytes_sent}
    finally:
        torch.set_default_dtype(torch.float32)


def _router(model) -> torch.Tensor | float:
    """The MoE layers' aux + z of the forward (0 for a dense model)."""
    loss = take_router_loss(model)
    return 0.0 if loss is None else loss


def train_cp(overrides: list[str], run_dir: str) -> list[dict]:
    """The real Trainer (fp32, 4 steps, eval every 2); per step loss, grad norm, eval loss and
    the cp bytes this rank sent."""
    from tests.parallel.trainer_runs import STEPS, run_trainer

    trainer = run_trainer(["train.eval_every=2", *overrides], run_dir, steps=STEPS)
    keys = ("loss", "grad_norm", "eval_loss", "comm_cp_bytes", "padding_fraction")
    cfg = trainer.cfg
    expected = cfg.grad_accum * cfg.model.n_layers * ring_bytes(
        batch=cfg.train.micro_batch_size, kv_heads=cfg.model.n_kv_heads,
        shard_len=cfg.train.seq_len // cfg.parallel.cp, head_dim=cfg.model.head_dim,
        elem_bytes=4, cp=cfg.parallel.cp, transport=cfg.parallel.cp_comm,
        recompute=cfg.train.activation_checkpointing)
    return [{**{k: h.get(k) for k in keys}, "expected_cp_bytes": expected}
            for h in trainer.history]


def cp_triton_equals_single(documents: bool) -> dict:
    """cp_equals_single with hpctrain's Triton kernels as the block math, under the
    interpreter (slow: one layer, 2 query heads on 1 kv head, 16 tokens), against eager
    attention in one process."""
    interpret_triton()
    return cp_equals_single("triton", documents, L=16, reference="eager", n_layers=1,
                            heads=(2, 1))


def ring_blocks(cp: int = 2, C: int = 8, seed: int = 0):
    """Every non-empty block of every rank of random packings (three rows: one long document,
    a few, many), as (Block, q, k, v, dO, O, lse, D) in fp64 with GQA (4 query, 2 kv heads); O
    and lse stand for the row's final ones, D = rowsum(dO ⊙ O)."""
    gen = torch.Generator().manual_seed(seed)
    L = 2 * cp * C
    starts = torch.rand(3, L, generator=gen) < torch.tensor([[0.0], [0.1], [0.4]])
    docs = Documents.from_ids(torch.cumsum(starts.long(), dim=1))
    for rank in range(cp):
        shard = shard_documents(docs, rank=rank, cp=cp)
        for kv_rank in range(cp):
            for x in (0, 1):
                for y in (0, 1):
                    block = block_mask(shard, kv_rank=kv_rank, x=x, y=y)
                    if block is None:
                        continue
                    q, do, o = (torch.randn(3, 4, C, 8, generator=gen, dtype=torch.float64)
                                for _ in range(3))
                    k, v = (torch.randn(3, 2, C, 8, generator=gen, dtype=torch.float64)
                            for _ in range(2))
                    lse = torch.randn(3, 4, C, generator=gen, dtype=torch.float64).abs() + 3
                    yield block, q, k, v, do, o, lse, (do * o).sum(-1)

"""All-gather context parallelism (`parallel.cp_comm=allgather`): the same zigzag shards and
blocks as the ring, but every rank's key/value shard is all-gathered once per layer, and the
dk/dv of every shard are reduce-scattered back in the backward pass.

Legend: B batch, N query heads, K kv heads, S shard length, H head dim, R = cp.
Per layer and micro-batch a rank sends, by the ring algorithms of the collectives: the
gather (R−1)·kv forward, again (R−1)·kv in backward (the gathered shards are not kept, to hold
the same memory as the ring between forward and backward) and (R−1)·kv for the
reduce-scatter: 3·(R−1) shards against the ring's 3R−2, in 3 collectives instead of 3R−1
point-to-point steps. So it is cheaper where the ring's per-step latency dominates: with few
kv heads (GQA: a kv shard is N/K times smaller than the queries) and short shards, where
each p2p step is too small to hide behind its block's compute. The gathered shards cost
R·kv bytes of memory during each layer's attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.parallel.context.ring import (
    RingComm,
    _chunks,
    attend,
    attend_backward,
    backward_inputs,
    output,
)
from hpctrain.parallel.context.shard import ShardDocuments


def _gather(kv_2BKSH: torch.Tensor, comm: RingComm) -> torch.Tensor:
    """R×2×B×K×S×H: every cp rank's key/value shard, in cp rank order."""
    out = kv_2BKSH.new_empty(comm.size * 2, *kv_2BKSH.shape[1:])  # gloo: gathered on dim 0
    work = dist.all_gather_single(out, kv_2BKSH.contiguous(), group=comm.group, async_op=True)
    work.wait(comm.timeout)
    comm.bytes_sent += (comm.size - 1) * kv_2BKSH.numel() * kv_2BKSH.element_size()
    return out.view(comm.size, *kv_2BKSH.shape)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNSH, k_BKSH, v_BKSH, docs: ShardDocuments, comm: RingComm):
        kv_2BKSH = torch.stack([k_BKSH, v_BKSH])
        every = _gather(kv_2BKSH, comm)
        q, acc = _chunks(q_BNSH), [None, None]
        for src in [comm.rank] + [r for r in range(comm.size) if r != comm.rank]:
            attend(acc, q, every[src], src=src, docs=docs, comm=comm)  # own shard first
        o_BNSH, lse_BNS = output(acc, q_BNSH.dtype)
        ctx.save_for_backward(q_BNSH, kv_2BKSH, o_BNSH, lse_BNS)
        ctx.docs, ctx.comm = docs, comm
        return o_BNSH

    @staticmethod
    def backward(ctx, do_BNSH):
        q_BNSH, kv_2BKSH, o_BNSH, lse_BNS = ctx.saved_tensors
        comm = ctx.comm
        every = _gather(kv_2BKSH, comm)
        q, do, o, lse, d, dq = backward_inputs(do_BNSH, q_BNSH, o_BNSH, lse_BNS)
        d_every = torch.zeros_like(every)
        for src in range(comm.size):
            attend_backward(dq, d_every[src], q, every[src], do, o, lse, d, src=src,
                            docs=ctx.docs, comm=comm)
        dkv_2BKSH = torch.empty_like(kv_2BKSH)
        work = dist.reduce_scatter_single(dkv_2BKSH, d_every.flatten(0, 1), group=comm.group,
                                          async_op=True)
        work.wait(comm.timeout)
        comm.bytes_sent += (comm.size - 1) * kv_2BKSH.numel() * kv_2BKSH.element_size()
        return torch.cat(dq, dim=2).to(q_BNSH.dtype), dkv_2BKSH[0], dkv_2BKSH[1], None, None


def allgather_attention(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                        docs: ShardDocuments, *, comm: RingComm) -> torch.Tensor:
    """What ring_attention computes (o_BNSH of this rank's zigzag query shard), with the
    key/value shards all-gathered instead of passed around the ring."""
    if not isinstance(docs, ShardDocuments):
        raise TypeError("all-gather attention needs the zigzag shard's boundaries "
                        "(ShardDocuments from hpctrain.parallel.context.shard)")
    return _AllGatherAttention.apply(q_BNSH, k_BKSH, v_BKSH, docs, comm)

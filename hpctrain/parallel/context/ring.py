"""Ring attention over the cp group: queries stay, key/value shards travel the ring.

Legend: B batch, N query heads, K kv heads, S = 2C a rank's shard (two zigzag chunks of C
tokens, hpctrain.parallel.context.shard), H head dim.

Forward: at step s (0..cp−1) rank i holds the key/value shard of rank (i − s) mod cp; it
posts the send of that shard to rank i+1 and the receive of the next one from rank i−1,
computes its blocks meanwhile (overlap), then waits. Each of its two query chunks keeps a
running (o, lse) merged by the online-softmax rule (blocks.merge). Backward: the key/value
shards travel the same way with their dk/dv accumulators; after cp steps every accumulator
is back at its owner. A (query chunk, key chunk) block is computed only if the causal and
document mask leaves something in it (a key chunk after the query chunk never is).
Every wait gives up after the mesh's timeout.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hpctrain.parallel.context.backends import block_functions
from hpctrain.parallel.context.blocks import Block, compute_dtype, merge
from hpctrain.parallel.context.shard import ShardDocuments, chunk_ids

FORWARD_TAG, BACKWARD_KV_TAG, BACKWARD_GRAD_TAG = 1, 2, 3


def ring_shards(*, cp: int, transport: str = "ring", recompute: str = "none") -> int:
    """Key/value shards one rank sends per attention layer, forward + backward of a
    micro-batch: the ring sends its shard cp−1 times forward, cp−1 times backward with its
    dk/dv accumulator (same size) cp times: 3·cp − 2; the all-gather transport 3·(cp − 1)
    (context.allgather). Full recompute reruns the forward: cp − 1 more for either."""
    if cp == 1:
        return 0
    shards = 3 * (cp - 1) if transport == "allgather" else 3 * cp - 2
    return shards + (cp - 1 if recompute == "full" else 0)


def ring_bytes(*, batch: int, kv_heads: int, shard_len: int, head_dim: int, elem_bytes: int,
               cp: int, transport: str = "ring", recompute: str = "none") -> int:
    """Bytes one rank sends per attention layer for one forward + backward of a micro-batch:
    ring_shards key/value shards of 2·B·K·S·H elements each."""
    shards = ring_shards(cp=cp, transport=transport, recompute=recompute)
    return shards * 2 * batch * kv_heads * shard_len * head_dim * elem_bytes


class RingComm:
    """The cp group's ring: neighbours, the timeout, and counters (computed blocks, bytes
    sent) that the work-balance test and the `comm_cp_bytes` metric read."""

    def __init__(self, group: dist.ProcessGroup, *, timeout: datetime.timedelta,
                 backend: str = "eager"):
        self.group, self.timeout = group, timeout
        # The per-block math of the model's attention backend (context/backends.py).
        self.block_forward, self.block_backward = block_functions(backend)
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.blocks = 0
        self.bytes_sent = 0

    def shift(self, x: torch.Tensor, *, tag: int):
        """Send `x` to the next rank and receive the previous rank's tensor of the same
        shape; returns a wait() → the received tensor (the send is complete by then)."""
        payload, out = x.contiguous(), torch.empty_like(x)
        sent = dist.isend(payload, dst=self.next, group=self.group, tag=tag)
        got = dist.irecv(out, src=self.prev, group=self.group, tag=tag)
        self.bytes_sent += payload.numel() * payload.element_size()

        def wait() -> torch.Tensor:
            got.wait(self.timeout)
            sent.wait(self.timeout)
            return out
        return wait


def block_mask(docs: ShardDocuments, *, kv_rank: int, x: int, y: int) -> Block | None:
    """The Block of query chunk x (0/1) of this rank against key chunk y of `kv_rank`, or None
    when it is empty, decided from the chunk indices and the document boundaries alone (no
    mask is formed): a key chunk after the query chunk is empty; the diagonal block never is
    (each token sees itself); an earlier key chunk holds every key before every query, and
    ids are non-decreasing along a row (Documents.from_ids), so some query shares a document
    with some key exactly when a row's first query and last key share one."""
    qc, kc = chunk_ids(docs.rank, cp=docs.cp)[x], chunk_ids(kv_rank, cp=docs.cp)[y]
    if kc > qc:
        return None
    C = docs.ids_BL.shape[1] // 2
    ids_q_BC = docs.ids_BL[:, x * C:(x + 1) * C]
    ids_k_BC = docs.ids_of(kv_rank)[:, y * C:(y + 1) * C]
    whole_rows = docs.ids_BL.device.type == "meta"  # the dry run's rows: one document each
    if kc < qc and not whole_rows and not bool((ids_q_BC[:, 0] == ids_k_BC[:, -1]).any()):
        return None
    return Block(ids_q_BC=ids_q_BC, ids_k_BC=ids_k_BC, diagonal=kc == qc)


def _chunks(x_BXSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x_BXSH.chunk(2, dim=2)


def attend(acc: list, q: tuple, kv_2BKSH, *, src: int, docs: ShardDocuments, comm) -> None:
    """Merge the blocks of this rank's query chunks `q` against cp rank `src`'s key/value
    shard into the running (o, lse) pairs `acc` (one per query chunk; None before the first)."""
    k, v = _chunks(kv_2BKSH[0]), _chunks(kv_2BKSH[1])
    for x in (0, 1):
        for y in (x, 1 - x):  # the diagonal block first: every running lse is finite
            block = block_mask(docs, kv_rank=src, x=x, y=y)
            if block is None:
                continue
            comm.blocks += 1
            part = comm.block_forward(q[x], k[y], v[y], block)
            acc[x] = part if acc[x] is None else merge(*acc[x], *part)


def attend_backward(dq: list, dkv_2BKSH, q, kv_2BKSH, do, o, lse, d, *, src: int,
                    docs: ShardDocuments, comm: RingComm) -> None:
    """Accumulate into dq (per query chunk) and `dkv_2BKSH` (of `src`'s shard) the gradients
    of the blocks `attend` computed against `src`'s key/value shard."""
    k, v = _chunks(kv_2BKSH[0]), _chunks(kv_2BKSH[1])
    dk, dv = _chunks(dkv_2BKSH[0]), _chunks(dkv_2BKSH[1])
    for x in (0, 1):
        for y in (0, 1):
            block = block_mask(docs, kv_rank=src, x=x, y=y)
            if block is None:
                continue
            gq, gk, gv = comm.block_backward(q[x], k[y], v[y], block, do[x], o[x], lse[x], d[x])
            dq[x] += gq
            dk[y].add_(gk)
            dv[y].add_(gv)


def output(acc: list, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BNSH in the inputs' dtype, lse_BNS) of the two query chunks' merged blocks (merged
    in blocks.compute_dtype: fp32 under bf16, as a fused kernel accumulates). Laid out
    B×S×N×H in memory, as sdpa's output is, so the block's o.transpose(1, 2).reshape for the
    output projection is a view (a B×N×S×H layout made it copy, and save, the output twice)."""
    o_BSNH = torch.cat([acc[0][0].transpose(1, 2), acc[1][0].transpose(1, 2)], dim=1).to(dtype)
    return o_BSNH.transpose(1, 2), torch.cat([acc[0][1], acc[1][1]], dim=2)


def backward_inputs(do_BNSH, q_BNSH, o_BNSH, lse_BNS):
    """Per query chunk: q, dO, O, lse, D = rowsum(dO ⊙ O) (in the compute dtype) and the dq
    accumulators (compute dtype: each block's dq adds without rounding to bf16)."""
    acc = compute_dtype(q_BNSH.dtype)
    d_BNS = (do_BNSH.to(acc) * o_BNSH.to(acc)).sum(-1)
    q, do, o = _chunks(q_BNSH), _chunks(do_BNSH.contiguous()), _chunks(o_BNSH)
    dq = [torch.zeros_like(q[0], dtype=acc), torch.zeros_like(q[1], dtype=acc)]
    return q, do, o, lse_BNS.chunk(2, -1), d_BNS.chunk(2, -1), dq


def _forward(q_BNSH, kv_2BKSH, docs: ShardDocuments, comm: RingComm):
    """(o_BNSH, lse_BNS) of this rank's queries against every rank's keys."""
    q = _chunks(q_BNSH)
    acc: list = [None, None]
    for step in range(comm.size):
        src = (comm.rank - step) % comm.size
        pending = comm.shift(kv_2BKSH, tag=FORWARD_TAG) if step < comm.size - 1 else None
        attend(acc, q, kv_2BKSH, src=src, docs=docs, comm=comm)
        if pending is not None:
            kv_2BKSH = pending()
    return output(acc, q_BNSH.dtype)


def _backward(do_BNSH, q_BNSH, kv_2BKSH, o_BNSH, lse_BNS, docs, comm: RingComm):
    """(dq_BNSH, dk_BKSH, dv_BKSH): dk/dv accumulators travel with their key/value shard, in
    its dtype (the bytes of ring_bytes)."""
    q, do, o, lse, d, dq = backward_inputs(do_BNSH, q_BNSH, o_BNSH, lse_BNS)
    dkv_2BKSH = torch.zeros_like(kv_2BKSH)
    for step in range(comm.size):
        src = (comm.rank - step) % comm.size
        pending = comm.shift(kv_2BKSH, tag=BACKWARD_KV_TAG) if step < comm.size - 1 else None
        attend_backward(dq, dkv_2BKSH, q, kv_2BKSH, do, o, lse, d, src=src, docs=docs,
                        comm=comm)
        dkv_2BKSH = comm.shift(dkv_2BKSH, tag=BACKWARD_GRAD_TAG)() if comm.size > 1 else dkv_2BKSH
        if pending is not None:
            kv_2BKSH = pending()
    return torch.cat(dq, dim=2).to(q_BNSH.dtype), dkv_2BKSH[0], dkv_2BKSH[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNSH, k_BKSH, v_BKSH, docs, comm):
        kv_2BKSH = torch.stack([k_BKSH, v_BKSH])
        o_BNSH, lse_BNS = _forward(q_BNSH, kv_2BKSH, docs, comm)
        ctx.save_for_backward(q_BNSH, kv_2BKSH, o_BNSH, lse_BNS)
        ctx.docs, ctx.comm = docs, comm
        return o_BNSH

    @staticmethod
    def backward(ctx, do_BNSH):
        q_BNSH, kv_2BKSH, o_BNSH, lse_BNS = ctx.saved_tensors
        dq, dk, dv = _backward(do_BNSH, q_BNSH, kv_2BKSH, o_BNSH, lse_BNS,
                               ctx.docs, ctx.comm)
        return dq, dk, dv, None, None


def ring_attention(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                   docs: ShardDocuments, *, comm: RingComm) -> torch.Tensor:
    """Causal (document-masked) attention of this rank's zigzag query shard against the
    whole row, whose key/value shards are spread over `comm`'s cp ranks; returns o_BNSH,
    equal to the single-process attention's rows of this shard."""
    if not isinstance(docs, ShardDocuments):
        raise TypeError("ring attention needs the zigzag shard's boundaries (ShardDocuments "
                        "from hpctrain.parallel.context.shard.shard_micro_batch)")
    return _RingAttention.apply(q_BNSH, k_BKSH, v_BKSH, docs, comm)

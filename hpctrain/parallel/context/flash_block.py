"""The `flash` backend's block of ring attention: flash-attn's variable-length kernels on one
(query chunk, key chunk) block.

Legend: B batch, N query heads, K kv heads, C chunk length, H head dim, T = B·C tokens, G the
varlen segments.
flash-attn's public functions return a log-sum-exp without gradient, and ring attention runs
each block's backward against the row's final lse (blocks.py). The entry points beneath them
take it: `flash_attn_interface._wrapped_flash_attn_varlen_forward` / `…_backward`, private,
whose signatures hold from flash-attn 2.7.0 through 2.8.x (FLASH_VERSIONS; the extra pins that
range and config validation checks the installed version before launch). They are called by
keyword, so a renamed argument fails loudly, never silently.

A block is one varlen call over segments of (query run, key run), built on the device from the
chunks' document ids with one host sync per block and micro-batch (`segments`): on the diagonal
block each document's run against itself (causal; the runs of a row tile it); on an earlier key
chunk three per row: the row's first query document against the last key document — the only
one they can share (ids are non-decreasing along a row: ring.block_mask) — every key visible,
with the keys before that run as a segment of no queries and the queries after it as one of no
keys. So no
C×C mask exists and the kernel visits only what some query sees. Rows with no keys: flash
writes o = 0 and lse = +inf; the ring's merge takes −inf. The backward is the varlen backward
with the row's final O and lse (its D = rowsum(dO ⊙ O), the row's own), into zeroed dq/dk/dv
(a key no query sees keeps 0). Head dims not a multiple of 8 are zero-padded, as flash-attn's
public functions do.
"""

from __future__ import annotations

import math

import torch

from hpctrain.parallel.context.blocks import Block, BlockCache, compute_dtype

FLASH_VERSIONS = ("2.7.0", "2.9")  # [first, end): the private signatures called below


def version_problem() -> str | None:
    """Why the installed flash-attn cannot run ring attention's blocks, with the fix; None if
    it can or is not installed (ops.attention_flash.flash_problem refuses that case)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("flash-attn")
    except PackageNotFoundError:
        return None
    first, end = FLASH_VERSIONS
    if _release(first) <= _release(found) < _release(end):
        return None
    return (f"model.attention=flash under parallel.cp runs flash-attn's varlen kernels through "
            f"entry points that take the row's log-sum-exp, whose signatures hpctrain calls as "
            f"they are in flash-attn {first} up to {end} (excluded); this one is {found}: "
            f"pip install 'flash-attn>={first},<{end}', or use model.attention=flex or triton")


def _release(text: str) -> tuple[int, ...]:
    """(2, 8, 3) of "2.8.3.post1"."""
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _kernels():
    from flash_attn import flash_attn_interface as fa  # CUDA only: validation checks first

    return fa._wrapped_flash_attn_varlen_forward, fa._wrapped_flash_attn_varlen_backward


def _segments(block: Block) -> tuple[torch.Tensor, torch.Tensor, int]:
    ids_q, ids_k = block.ids_q_BC, block.ids_k_BC
    B, C = ids_q.shape
    if block.diagonal:  # one segment per document run (runs never cross rows)
        starts_BC = torch.ones_like(ids_q, dtype=torch.bool)
        starts_BC[:, 1:] = ids_q[:, 1:] != ids_q[:, :-1]
        run_T = torch.cumsum(starts_BC.flatten(), 0) - 1  # each token's run
        lens = torch.zeros(B * C, dtype=torch.int64, device=ids_q.device)
        lens.scatter_add_(0, run_T, torch.ones_like(lens))
        lens_q = lens_k = lens
        count = run_T[-1] + 1
    else:
        first_B1 = ids_q[:, :1]
        shared_B = (ids_k == first_B1).sum(1)  # the last key run, if it is the first query's
        a_B = torch.where(shared_B > 0, (ids_q == first_B1).sum(1), 0)
        zero_B = torch.zeros_like(a_B)
        lens_q = torch.stack([zero_B, a_B, C - a_B], dim=1).flatten()
        lens_k = torch.stack([C - shared_B, shared_B, zero_B], dim=1).flatten()
        count = torch.tensor(3 * B, device=ids_q.device)
    # the one host sync: the segment count and the longest (flash-attn reads max_seqlen_q = 1
    # as a decode step and reshapes, so the bound is at least 2; it only sizes the grid)
    G, longest_q, longest_k = torch.stack([count, lens_q.max(), lens_k.max()]).tolist()
    longest = max(longest_q, longest_k, 2)

    def offsets(lens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(torch.cumsum(lens[:G], 0), (1, 0)).to(torch.int32)

    return offsets(lens_q), offsets(lens_k), longest


_cache = BlockCache(_segments)


def segments(block: Block) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cu_seqlens_q, cu_seqlens_k): int32 offsets of the G segments into the block's T query
    and T key tokens, and the longest segment (at least 2), built once per micro-batch and
    block (one host sync) and reused by every layer and the backward."""
    return _cache.get(block)


def _tokens(x_BXCH: torch.Tensor, width: int) -> torch.Tensor:
    """T×X×width, contiguous, zero-padded from H to width."""
    B, X, C, H = x_BXCH.shape
    x_TXH = x_BXCH.transpose(1, 2).reshape(B * C, X, H)
    return torch.nn.functional.pad(x_TXH, (0, width - H)).contiguous() if width > H \
        else x_TXH.contiguous()


def _heads(x_TXW: torch.Tensor, B: int, H: int) -> torch.Tensor:
    T, X, _ = x_TXW.shape
    return x_TXW[..., :H].reshape(B, T // B, X, H).transpose(1, 2)


def _width(H: int) -> int:
    return -(-H // 8) * 8


def flash_block_forward(q_BNCH, k_BKCH, v_BKCH, block: Block):
    """(o_BNCH, lse_BNC) of one block by flash-attn's varlen forward; rows no key reaches get
    o = 0 and lse = −inf."""
    forward, _ = _kernels()
    B, N, C, H = q_BNCH.shape
    cu_q, cu_k, bound = segments(block)
    q, k, v = (_tokens(x, _width(H)) for x in (q_BNCH, k_BKCH, v_BKCH))
    o_TNW, lse_NT = forward(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=bound, max_seqlen_k=bound, dropout_p=0.0,
                            softmax_scale=1 / math.sqrt(H), causal=block.diagonal)[:2]
    lse_BNC = lse_NT.view(N, B, C).transpose(0, 1)
    return _heads(o_TNW, B, H), lse_BNC.masked_fill(lse_BNC == math.inf, -math.inf)


def flash_block_backward(q_BNCH, k_BKCH, v_BKCH, block: Block, do_BNCH, o_BNCH, lse_BNC,
                         d_BNC):
    """(dq_BNCH, dk_BKCH, dv_BKCH) of one block by flash-attn's varlen backward, against the
    row's final O and lse (D is the kernel's own rowsum(dO ⊙ O): `d_BNC` is not read)."""
    _, backward = _kernels()
    B, N, C, H = q_BNCH.shape
    W = _width(H)
    cu_q, cu_k, bound = segments(block)
    q, k, v = (_tokens(x, W) for x in (q_BNCH, k_BKCH, v_BKCH))
    do, o = (_tokens(x.to(q.dtype), W) for x in (do_BNCH, o_BNCH))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse_NT = lse_BNC.transpose(0, 1).reshape(N, B * C).to(compute_dtype(q.dtype)).contiguous()
    backward(dout=do, q=q, k=k, v=v, out=o, softmax_lse=lse_NT, dq=dq, dk=dk, dv=dv,
             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=bound, max_seqlen_k=bound,
             dropout_p=0.0, softmax_scale=1 / math.sqrt(H), causal=block.diagonal,
             window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
             deterministic=False, rng_state=None)
    return _heads(dq, B, H), _heads(dk, B, H), _heads(dv, B, H)

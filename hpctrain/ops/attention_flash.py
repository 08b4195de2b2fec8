"""The `flash` attention backend: the flash-attn package's kernels (CUDA, bf16/fp16).

Legend: B batch, N query heads, K key/value heads, L sequence, H head dim, T = B·L tokens.
Without documents: `flash_attn_func(q_BLNH, k_BLKH, v_BLKH, causal=True)`. With documents the
rows are flattened to T tokens and every document becomes one sequence of
`flash_attn_varlen_func` (cu_seqlens from Documents.cu_seqlens), so no token sees another
document. flash-attn does grouped-query attention itself (N a multiple of K), without copies.
Install with `pip install hpctrain[flash]` on a CUDA machine; config validation refuses
model.attention=flash elsewhere, with the extra and the device in the message. Under
parallel.cp each ring block is one varlen call through flash-attn's private entry points
(hpctrain.parallel.context.flash_block; the installed version is checked before launch).
"""

from __future__ import annotations

import importlib.util

import torch

from hpctrain.ops.documents import Documents
from hpctrain.ops.documents_cache import LastDocuments

_cu_seqlens = LastDocuments(Documents.cu_seqlens)  # one host sync per batch, not per layer


def flash_problem(*, device_type: str, precision: str) -> str | None:
    """Why model.attention=flash cannot run here, with the fix; None if it can."""
    installed = importlib.util.find_spec("flash_attn") is not None
    if device_type != "cuda" or not installed:
        return (f"model.attention=flash runs flash-attn's CUDA kernels: it needs a CUDA device "
                f"(this job's is {device_type}) and the optional extra 'flash' (pip install "
                f"'hpctrain[flash]'; flash-attn is {'' if installed else 'not '}installed here):"
                " use model.attention=sdpa or triton, or run on cluster.device=cuda")
    if precision not in ("bf16", "fp16"):
        return (f"model.attention=flash computes in bf16/fp16 only but train.precision="
                f"{precision}: set train.precision=bf16, or use model.attention=sdpa")
    return None


def flash_backend(q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor,
                  docs: Documents | None = None) -> torch.Tensor:
    """Causal (document-masked) GQA attention through flash-attn; inputs bf16/fp16 on CUDA."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    B, N, L, H = q_BNLH.shape
    q_BLNH, k_BLKH, v_BLKH = (x.transpose(1, 2) for x in (q_BNLH, k_BKLH, v_BKLH))
    if docs is None:
        return flash_attn_func(q_BLNH, k_BLKH, v_BLKH, causal=True).transpose(1, 2)
    cu_seqlens, longest = _cu_seqlens.get(docs)
    q_TNH, k_TKH, v_TKH = (x.reshape(B * L, x.shape[2], H) for x in (q_BLNH, k_BLKH, v_BLKH))
    o_TNH = flash_attn_varlen_func(q_TNH, k_TKH, v_TKH, cu_seqlens, cu_seqlens, longest, longest,
                                   causal=True)
    return o_TNH.view(B, L, N, H).transpose(1, 2)

"""Attention backends behind one signature, selected by name (`model.attention`).

Legend: B batch, N query heads, K key/value heads, L sequence, H head dim.
Every backend computes causal softmax(q kᵀ / √H) v with grouped-query attention (each group
of N/K query heads shares one key/value head) and returns out_BNLH.
`eager` is the O(L²) reference that every other backend is tested against; `sdpa` is torch's
fused kernel; `flex` (ops/attention_flex.py), `flash` (ops/attention_flash.py) and `triton`
(hpctrain's own FlashAttention-2 kernel, ops/triton_attention.py) are fused backends whose
device and dtype limits `backend_problem` states before a run starts.
With `docs` (packed rows, see ops/documents.py) a query attends only to earlier keys of its
own document; without, the whole row is one document.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hpctrain.ops.attention_flash import flash_backend, flash_problem
from hpctrain.ops.attention_flex import CPU_TRAINING_REFUSED, flex_backend
from hpctrain.ops.documents import Documents
from hpctrain.ops.triton_attention import mode_problem, triton_attention

AttentionFn = Callable[..., torch.Tensor]  # (q_BNLH, k_BKLH, v_BKLH, docs=None) -> out_BNLH


def _repeat_kv(x_BKLH: torch.Tensor, groups: int) -> torch.Tensor:
    return x_BKLH if groups == 1 else x_BKLH.repeat_interleave(groups, dim=1)


def eager_attention(q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor,
                    docs: Documents | None = None):
    """Reference: materialises the L×L score matrix in the input dtype."""
    groups = q_BNLH.shape[1] // k_BKLH.shape[1]
    k_BNLH, v_BNLH = _repeat_kv(k_BKLH, groups), _repeat_kv(v_BKLH, groups)
    L = q_BNLH.shape[2]
    scores_BNLL = q_BNLH @ k_BNLH.transpose(-1, -2) / math.sqrt(q_BNLH.shape[-1])
    if docs is None:
        mask_BNLL = torch.ones(L, L, dtype=torch.bool, device=q_BNLH.device).tril()
    else:
        mask_BNLL = docs.mask_BLL()[:, None]
    scores_BNLL = scores_BNLL.masked_fill(~mask_BNLL, float("-inf"))
    return torch.softmax(scores_BNLL, dim=-1) @ v_BNLH


def sdpa_attention(q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor,
                   docs: Documents | None = None):
    """torch's fused kernel: FlashAttention/cuDNN/memory-efficient on CUDA, flash on CPU.
    Documents become an explicit block-diagonal causal mask (which rules out the flash path)."""
    groups = q_BNLH.shape[1] // k_BKLH.shape[1]
    if q_BNLH.device.type == "meta" and docs is None:
        return _meta_fused(q_BNLH, k_BKLH, v_BKLH)
    if docs is None:
        return F.scaled_dot_product_attention(
            q_BNLH, k_BKLH, v_BKLH, is_causal=True, enable_gqa=groups > 1
        )
    return F.scaled_dot_product_attention(
        q_BNLH, k_BKLH, v_BKLH, attn_mask=docs.mask_BLL()[:, None], enable_gqa=groups > 1
    )


def _meta_fused(q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor):
    """sdpa on meta tensors (the dry run, hpctrain.tasks.dryrun.rank): torch's dispatcher
    picks its math path there (no fused kernel has a meta dispatch), which saves the L×L
    scores; the flash kernel called directly saves what the fused kernels save on a device
    (q, k, v with their own K heads, out, the fp32 log-sum-exp)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BNLH, k_BKLH, v_BKLH, 0.0, True)[0]


ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "flex": flex_backend,
    "flash": flash_backend,
    "triton": triton_attention,
}


def get_attention(name: str) -> AttentionFn:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"model.attention={name!r} is unknown; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]


def backend_problem(name: str, *, device_type: str, training: bool,
                    precision: str = "fp32") -> str | None:
    """Why backend `name` cannot run a job on `device_type` ("cpu"/"cuda") with these
    settings, with the fix; None if it can. Config validation calls this before launch."""
    if name == "flex" and training and device_type != "cuda":
        return CPU_TRAINING_REFUSED
    if name == "flash":
        return flash_problem(device_type=device_type, precision=precision)
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return ("model.attention=triton needs the triton package, not installed here: "
                    "pip install 'hpctrain[triton]', or use model.attention=sdpa")
        return mode_problem(device_type)
    return None

"""The `flex` attention backend: torch's flex_attention with a block mask from the documents.

Legend: B batch, N query heads, K key/value heads, L sequence, H head dim.
The mask is mask(b, i, j) = j ≤ i and ids[b, i] == ids[b, j]; `create_block_mask` turns it into
a BlockMask that lets the kernel skip every 128×128 block with no visible key.

What runs where in torch 2.13 (measured on this project's CPU machines):
  - CUDA: forward and backward, compiled (torch.compile of flex_attention, fused Triton).
  - CPU: forward only. fp32/bf16/fp16 run compiled (inductor's C++ flex kernel; the first call
    of a shape compiles, ~20 s on 2 cores); fp64 runs flex's unfused reference path (the tests'
    fp64 comparison). There is no backward on CPU: with inputs that require grad torch raises
    NotImplementedError, so this backend raises a ValueError naming the fix first, and config
    validation refuses training with model.attention=flex on CPU before any process starts.

Compilation is per shape (dynamic=False): each new (L, dtype, with/without documents) compiles
once; new documents in the same shape do not (their ids are an input of the graph). Past
torch._dynamo's recompile_limit (8 graphs) torch falls back to the unfused path with a warning
— a training run uses one or two shapes; the benchmarks, which sweep many, raise the limit.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from hpctrain.ops.documents import Documents
from hpctrain.ops.documents_cache import LastDocuments

# dtypes flex_attention compiles for on CPU (and on CUDA); others take the reference path.
COMPILED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CPU_TRAINING_REFUSED = ("model.attention=flex has no backward on CPU in torch "
                        f"{torch.__version__.split('+')[0]} (forward only): train with "
                        "model.attention=sdpa or eager on CPU, or use a CUDA device")


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=8)
def _causal_block_mask(L: int, device: str) -> BlockMask:
    return create_block_mask(_causal, None, None, L, L, device=device)


def documents_block_mask(docs: Documents) -> BlockMask:
    """BlockMask of causal attention inside each document of each row."""
    ids_BL = docs.ids_BL

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids_BL[b, q_idx] == ids_BL[b, kv_idx])

    B, L = ids_BL.shape
    return create_block_mask(same_doc_causal, B, None, L, L, device=str(ids_BL.device))


_last_docs_mask = LastDocuments(documents_block_mask)  # every layer of a forward reuses it


def flex_backend(q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor,
                 docs: Documents | None = None) -> torch.Tensor:
    """Causal (document-masked) GQA attention through flex_attention; see the module docstring
    for which directions and dtypes run on which device."""
    if q_BNLH.device.type == "cpu":
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q_BNLH, k_BKLH, v_BKLH)):
            raise ValueError(CPU_TRAINING_REFUSED)
        # flex refuses inputs that require grad even under no_grad (eval of a trained model)
        q_BNLH, k_BKLH, v_BKLH = q_BNLH.detach(), k_BKLH.detach(), v_BKLH.detach()
    L = q_BNLH.shape[2]
    if docs is None:
        block_mask = _causal_block_mask(L, str(q_BNLH.device))
    else:
        block_mask = _last_docs_mask.get(docs)
    groups = q_BNLH.shape[1] // k_BKLH.shape[1]
    if q_BNLH.dtype in COMPILED_DTYPES:
        return _compiled_flex()(q_BNLH, k_BKLH, v_BKLH, block_mask=block_mask,
                                enable_gqa=groups > 1)
    with warnings.catch_warnings():  # the unfused path is chosen on purpose (fp64)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q_BNLH, k_BKLH, v_BKLH, block_mask=block_mask,
                              enable_gqa=groups > 1)

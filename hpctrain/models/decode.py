"""A key/value cache for decoding: each new token attends to the keys and values kept from
the tokens before it instead of recomputing them (task=generate).

Legend: B batch, N query heads, K key/value heads, L tokens of this forward, T tokens seen
(cached and new), H head dim.

`Transformer.forward(x, cache=cache)` takes the L tokens at positions pos..pos+L-1 of every
row (pos = `cache.pos`: the prompt first, then one token a step). RoPE rotates them at those
absolute positions; each layer writes its rotated keys and its values into slots
pos..pos+L-1 and attends over slots 0..pos+L-1, query i seeing keys j ≤ pos+i; then pos
advances by L. The result equals the forward of the whole row so far (tests/unit/
test_generate.py checks it token for token and logit for logit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    """Every layer's keys and values (after RoPE) of the first `pos` tokens of each row,
    in buffers of `max_len` slots allocated at a layer's first write (its dtype, device and
    head count are its keys')."""

    def __init__(self, max_len: int):
        self.max_len, self.pos = max_len, 0
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def positions(self, x_BL: torch.Tensor, docs: object = None) -> torch.Tensor:
        """positions_BL of the next forward's tokens: pos, pos+1, ... in every row."""
        B, L = x_BL.shape[:2]
        if docs is not None:
            raise ValueError("a KV cache decodes one document per row: pass docs=None")
        if self.pos + L > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens: {self.pos} cached + "
                             f"{L} new do not fit; make it longer (at most the model's "
                             "max_seq_len)")
        return torch.arange(self.pos, self.pos + L, device=x_BL.device).expand(B, L)

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def advance(self, n: int) -> None:
        """After every layer wrote the forward's n tokens."""
        self.pos += n

    def attend(self, index: int, q_BNLH: torch.Tensor, k_BKLH: torch.Tensor,
               v_BKLH: torch.Tensor) -> torch.Tensor:
        """Store layer `index`'s new keys and values, then causal attention over all T."""
        p, L = self.pos, q_BNLH.shape[2]
        if index not in self._k:
            B, K, _, H = k_BKLH.shape
            self._k[index] = k_BKLH.new_zeros(B, K, self.max_len, H)
            self._v[index] = v_BKLH.new_zeros(B, K, self.max_len, H)
        self._k[index][:, :, p:p + L] = k_BKLH
        self._v[index][:, :, p:p + L] = v_BKLH
        k_BKTH, v_BKTH = self._k[index][:, :, :p + L], self._v[index][:, :, :p + L]
        # query i sits at position p+i and sees keys 0..p+i
        mask_LT = torch.ones(L, p + L, dtype=torch.bool, device=q_BNLH.device).tril(p)
        groups = q_BNLH.shape[1] // k_BKLH.shape[1]
        return F.scaled_dot_product_attention(q_BNLH, k_BKTH, v_BKTH, attn_mask=mask_LT,
                                              enable_gqa=groups > 1)


@dataclass(frozen=True)
class LayerCache:
    """One layer's view of a KVCache: what `Attention.forward` receives."""

    cache: KVCache
    index: int

    def attend(self, q_BNLH: torch.Tensor, k_BKLH: torch.Tensor,
               v_BKLH: torch.Tensor) -> torch.Tensor:
        return self.cache.attend(self.index, q_BNLH, k_BKLH, v_BKLH)

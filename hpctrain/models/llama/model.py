"""A Llama-style decoder-only transformer. No parallel code lives here.

Legend: B batch, L sequence, D model dim, N query heads, K kv heads, H head dim, F ffn dim,
V vocabulary. Parallel layouts replace the Linear/Embedding submodules from outside (by name),
so the names below (wq, wk, wv, wo, w1, w2, w3, tok_embeddings, output) are a public contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.models.decode import KVCache, LayerCache
from hpctrain.models.family import Part
from hpctrain.models.moe.layer import MoE
from hpctrain.ops.attention import get_attention
from hpctrain.ops.documents import Documents
from hpctrain.ops.linear import Linear
from hpctrain.ops.norms import RMSNorm
from hpctrain.ops.rope import apply_rope, rope_at, rope_tables

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of this batch's tokens (ops.rope.rope_at)


class AttentionCore(nn.Module):
    """softmax(q kᵀ/√H) v through the configured backend; its own module so that selective
    activation checkpointing can wrap exactly this part."""

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend
        self.fn = get_attention(backend)

    def forward(self, q_BNLH, k_BKLH, v_BKLH, docs: Documents | None = None):
        return self.fn(q_BNLH, k_BKLH, v_BKLH, docs)


class Attention(nn.Module):
    """Grouped-query attention: wq/wk/wv (with biases when `attention_bias`), per-head RMSNorm
    of q and k (`qk_norm`), RoPE, the attention core, wo. H = `head_dim`, which need not be
    D / N."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wv = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.core = AttentionCore(cfg.attention)

    def forward(self, x_BLD: torch.Tensor, rope: Rope, docs: Documents | None = None,
                cache: LayerCache | None = None):
        B, L, _ = x_BLD.shape
        # Head counts come from the projection widths, so a tensor-parallel shard that holds
        # N/tp heads runs this same code.
        q_BLNH = self.wq(x_BLD).view(B, L, -1, self.head_dim)
        k_BLKH = self.wk(x_BLD).view(B, L, -1, self.head_dim)
        if self.q_norm is not None:
            q_BLNH, k_BLKH = self.q_norm(q_BLNH), self.k_norm(k_BLKH)
        q_BNLH, k_BKLH = q_BLNH.transpose(1, 2), k_BLKH.transpose(1, 2)
        v_BKLH = self.wv(x_BLD).view(B, L, -1, self.head_dim).transpose(1, 2)
        q_BNLH, k_BKLH = apply_rope(q_BNLH, *rope), apply_rope(k_BKLH, *rope)
        if cache is not None:  # decoding: over this layer's cached keys too (models.decode)
            o_BNLH = cache.attend(q_BNLH, k_BKLH, v_BKLH)
        else:
            o_BNLH = self.core(q_BNLH, k_BKLH, v_BKLH, docs)
        return self.wo(o_BNLH.transpose(1, 2).reshape(B, L, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) ⊙ w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BLD)) * self.w3(x_BLD))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(cfg)

    def forward(self, x_BLD: torch.Tensor, rope: Rope, docs: Documents | None = None,
                cache: LayerCache | None = None):
        """Under sequence parallelism x_BLD is this rank's sequence shard, but attention runs
        after the entry all-gather on the whole row, so `rope` and `docs` cover all L tokens."""
        # training calls keep their three inputs (wrappers and DTensor plans see those)
        extra = () if cache is None else (cache,)
        h_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), rope, docs, *extra)
        return h_BLD + self.mlp(self.mlp_norm(h_BLD))


class Transformer(nn.Module):
    """tokens_BL → logits_BLV; or a part of the model (`Part`: a range of layers, with or
    without the embedding and the head), which is how a pipeline stage is built: without the
    embedding it takes hidden states h_BLD, without the head it returns them. Blocks are keyed
    by their global layer index (`layers.5...`), so every part's parameter names are the whole
    model's. With `docs` (packed rows) attention stays inside each document and RoPE positions
    restart at each document; without, each row is one document. With a `cache`
    (models.decode.KVCache, no docs) x holds the tokens after the cached ones."""

    def __init__(self, cfg: ModelConfig, part: Part | None = None):
        super().__init__()
        part = Part.whole(cfg) if part is None else part
        self.cfg = cfg
        # no default init: hpctrain initialises every weight by name (hpctrain.models.init), and
        # nn.Embedding's normal_ would fill V×D once more (on meta it imports torch's compiler)
        self.tok_embeddings = (nn.Embedding(cfg.vocab_size, cfg.dim,
                                            _weight=torch.empty(cfg.vocab_size, cfg.dim))
                               if part.embed else None)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in part.layers})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps) if part.head else None
        self.output = Linear(cfg.dim, cfg.vocab_size, bias=False) if part.head else None
        if cfg.tied_embeddings and part.embed and part.head:
            self.output.weight = self.tok_embeddings.weight
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._rope:
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len,
                                   theta=self.cfg.rope_theta, scaling=self.cfg.rope_scaling)
            self._rope[device] = (cos.to(device), sin.to(device))
        return self._rope[device]

    def forward(self, x: torch.Tensor, *, docs: Documents | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        h_BLD = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        tables = self.rope(h_BLD.device)
        rope = block_rope(tables, docs) if cache is None else rope_at(tables,
                                                                      cache.positions(x, docs))
        for i, block in self.layers.items():
            extra = () if cache is None else (cache.layer(int(i)),)
            h_BLD = block(h_BLD, rope, docs, *extra)
        if cache is not None:
            cache.advance(x.shape[1])
        if self.output is None:
            return h_BLD
        return self.output(self.norm(h_BLD))


def block_rope(tables: Rope, docs: Documents | None) -> Rope:
    """The RoPE angles every block of one forward uses: by row index, or restarting at each
    document of `docs`."""
    return rope_at(tables, None if docs is None else docs.positions_BL)

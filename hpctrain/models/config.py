"""Model shapes: a frozen description of a Llama-style decoder and its analytical counts.

The counts here are the single source for parameters and FLOPs: the planner, MFU and the
tests all read them, and a test checks them against the built model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts in place of the dense MLP of some blocks (`model.moe.*`).

    `num_experts=0` is a dense model (every other key is then ignored). Block i is an MoE block
    when (i + 1) % every == 0 (every=1: all blocks; every=2: the 2nd, 4th, ...). Each token goes
    to `top_k` of `num_experts` SwiGLU experts of hidden size `expert_ffn_dim` (0: the model's
    ffn_dim), plus `shared_experts` experts every token passes through. `capacity_factor=0` is
    dropless; c > 0 keeps at most ceil(c · tokens · top_k / num_experts) tokens per expert
    (deterministic dropping, lowest router priority first).
    """

    num_experts: int = 0
    top_k: int = 2
    every: int = 1
    shared_experts: int = 0
    expert_ffn_dim: int = 0
    router: Literal["softmax", "sigmoid"] = "softmax"
    aux_loss_coef: float = 0.01  # Switch/GShard load-balancing loss
    z_loss_coef: float = 0.001  # router z-loss (ST-MoE)
    capacity_factor: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (`model.rope_scaling.*`). `none`: inv_freq_i = θ^(−2i/H).
    `llama3` (Llama 3.1+): with wavelength λ_i = 2π / inv_freq_i and the pre-training context
    C = `original_max_seq_len`, frequencies with λ_i > C / `low_freq_factor` are divided by
    `factor`, those with λ_i < C / `high_freq_factor` are kept, and those between are blended:
    s = (C/λ_i − low) / (high − low), inv_freq_i ← (1 − s)·inv_freq_i/factor + s·inv_freq_i."""

    type: Literal["none", "llama3"] = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = False
    # 0: dim / n_heads. Set (as Hugging Face's head_dim) when heads × head_dim ≠ dim (Qwen3,
    # Gemma): wq maps dim → n_heads·head_dim and wo back.
    head_dim: int = 0
    attention_bias: bool = False  # biases on wq, wk, wv (Qwen2); wo has none
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    attention: str = "sdpa"  # a name of the ops.attention registry (validate_keys.REGISTRY_CHOICES)
    moe: MoEConfig = field(default_factory=MoEConfig)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # A local Hugging Face model directory: its config.json gives the shape (other model.*
    # keys may only agree with it) and its safetensors the initial weights (models.hf_config).
    init_from: str | None = None

    def __post_init__(self):
        if self.head_dim == 0 and self.n_heads > 0:  # derived: stored, so every reader agrees
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe.expert_ffn_dim or self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has routed experts instead of the dense MLP."""
        return self.moe.enabled and (layer + 1) % self.moe.every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def layer_params(self, layer: int = 0, *, active: bool = False) -> int:
        """Parameters of block `layer` (attention, MLP or router + experts, two RMSNorm
        weights); with `active`, only the experts one token uses (top_k routed + shared)."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q_dim * 2 + self.dim * kv_dim * 2  # wq, wo, wk, wv
        attn += self._attention_vectors
        if self.is_moe_layer(layer):
            m = self.moe
            routed = m.top_k if active else m.num_experts
            expert = 3 * self.dim * self.expert_ffn_dim  # w1 (gate), w3 (up), w2 (down)
            mlp = (routed + m.shared_experts) * expert + self.dim * m.num_experts  # + router
        else:
            mlp = 3 * self.dim * self.ffn_dim
        return attn + mlp + 2 * self.dim

    @property
    def _attention_vectors(self) -> int:
        """Parameters of a block's attention that are no matmul weight: q/k/v biases and the
        q/k norm gains."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return (q_dim + 2 * kv_dim) * self.attention_bias + 2 * self.head_dim * self.qk_norm

    def num_params(self, *, active: bool = False) -> int:
        """Parameters of the built model (a tied output head is counted once); with `active`,
        those one token uses (MoE: top_k of the routed experts)."""
        embed = self.vocab_size * self.dim
        head = 0 if self.tied_embeddings else self.vocab_size * self.dim
        blocks = sum(self.layer_params(i, active=active) for i in range(self.n_layers))
        return embed + blocks + self.dim + head

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward, no recomputation) per token at `seq_len`.

        6 FLOPs per multiply-accumulated weight (2 forward, 4 backward) over every matmul
        weight (all block matrices and the output head; the embedding is a lookup), plus the
        attention score and value products: 2·2·L·D per token per layer forward, ×3 for
        training. Causal masking is not discounted, matching eager attention's real work.
        """
        return self.training_flops(tokens=1, attended=seq_len)

    def training_flops(self, *, tokens: int, attended: int) -> int:
        """Training FLOPs of `tokens` tokens whose attention spans `attended` query-key pairs
        (unmasked count, as `flops_per_token`): L per token for rows of L tokens, and
        Σ lᵢ² over the documents of a packed batch (lᵢ their lengths), not L² per row.
        6·W·tokens + 12·n_layers·D·attended, W the active matmul weights (MoE: the router and
        the top_k + shared experts a token passes through)."""
        matmul_weights = sum(self.layer_params(i, active=True) - 2 * self.dim
                             - self._attention_vectors for i in range(self.n_layers))
        matmul_weights += self.vocab_size * self.dim
        q_dim = self.n_heads * self.head_dim  # the width of the score and value products
        return 6 * matmul_weights * tokens + 12 * self.n_layers * q_dim * attended

    def with_(self, **changes) -> ModelConfig:
        """A copy with `changes`; a derived head_dim (dim / n_heads) is derived again."""
        if "head_dim" not in changes and self.head_dim == self.dim // self.n_heads:
            changes["head_dim"] = 0
        return replace(self, **changes)


# Byte-level vocabulary: 256 bytes + end-of-document, padded to 512 so every tp up to 8 divides.
_BYTE_VOCAB = 512

PRESETS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig("debug", _BYTE_VOCAB, 32, 4, 4, 2, 96, 128),
        ModelConfig("tiny", _BYTE_VOCAB, 128, 4, 4, 2, 352, 256),
        ModelConfig("small", _BYTE_VOCAB, 384, 8, 6, 2, 1024, 512),
        ModelConfig("medium", 32000, 1024, 24, 16, 8, 2816, 2048),
        ModelConfig("llama3_1b", 128256, 2048, 16, 32, 8, 8192, 8192, rope_theta=500000.0,
                    tied_embeddings=True),
        ModelConfig("llama3_8b", 128256, 4096, 32, 32, 8, 14336, 8192, rope_theta=500000.0),
        ModelConfig("llama3_70b", 128256, 8192, 80, 64, 8, 28672, 8192, rope_theta=500000.0),
        ModelConfig("llama3_405b", 128256, 16384, 126, 128, 8, 53248, 8192, rope_theta=500000.0),
        # Tiny routed-experts model for CPU runs and tests: 8 experts (top 2) in every 2nd block.
        ModelConfig("debug_moe", _BYTE_VOCAB, 32, 4, 4, 2, 96, 128,
                    moe=MoEConfig(num_experts=8, top_k=2, every=2, expert_ffn_dim=48)),
        # Mixtral-8x7B (Jiang et al. 2024): 46.7B total, 12.9B active parameters.
        ModelConfig("mixtral_8x7b", 32000, 4096, 32, 32, 8, 14336, 32768, rope_theta=1e6,
                    moe=MoEConfig(num_experts=8, top_k=2)),
        # DeepSeekMoE-16B (Dai et al. 2024): 64 fine-grained routed experts (top 6) + 2 shared;
        # its layer 0 is dense (ffn 10944), here every layer is MoE (see conf/model yaml).
        ModelConfig("deepseek_moe_16b", 102400, 2048, 28, 16, 16, 10944, 4096, norm_eps=1e-6,
                    moe=MoEConfig(num_experts=64, top_k=6, shared_experts=2,
                                  expert_ffn_dim=1408)),
    )
}

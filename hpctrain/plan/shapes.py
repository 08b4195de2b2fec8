"""Model shapes the planner accepts, and the counts it derives from them.

Two shapes share one duck type (n_layers, dim, n_heads, vocab_size, tied_embeddings,
layer_params(), num_params(), flops_per_token(seq_len)):

- `hpctrain.models.config.ModelConfig`: the Llama-style models hpctrain trains.
- `GPTShape`: the GPT-2/3 style models of Megatron-LM's papers (MHA, LayerNorm, 4h GELU MLP,
  learned positions, tied output head), so the planner can be checked against their tables.

Symbols: l layers, h hidden, a heads, V vocabulary, s sequence length, t tp, p pp.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.models.config import ModelConfig
from hpctrain.plan.experts import expert_params, is_moe


@dataclass(frozen=True)
class GPTShape:
    """A Megatron GPT model: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)) parameters.

    Per layer 12h² matmul weights (QKV 3h², proj h², MLP 8h²) + 13h (biases and two
    LayerNorms); embeddings (V+s)·h (word + learned positions); the output head is tied.
    """

    name: str
    n_layers: int
    dim: int
    n_heads: int
    vocab_size: int
    max_seq_len: int
    tied_embeddings: bool = True
    # Megatron-LM 2021/2022 ran eager attention (fused scale-mask-softmax over the L×L scores);
    # its Transformer Engine runs (2023–) a fused flash kernel: attention="flash".
    attention: str = "eager"

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads

    @property
    def ffn_dim(self) -> int:
        return 4 * self.dim

    def layer_params(self) -> int:
        return 12 * self.dim**2 + 13 * self.dim

    def num_params(self) -> int:
        h = self.dim
        return self.n_layers * self.layer_params() + (self.vocab_size + self.max_seq_len) * h

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token without recomputation: 72·l·h²·(1 + s/(6h) + V/(12·l·h)).

        Megatron's F = 72·B·s·l·h²·(…) per iteration divided by the B·s tokens; with full
        recomputation `training_flops_per_token` gives their 96·l·h²·(1 + s/(6h) + V/(16·l·h)).
        """
        l, h = self.n_layers, self.dim
        return 72 * l * h * h + 12 * l * h * seq_len + 6 * self.vocab_size * h


Shape = ModelConfig | GPTShape


def head_flops_per_token(model: Shape) -> int:
    """Output-head matmul: 6·V·h per token (2 forward, 4 backward); never recomputed."""
    return 6 * model.vocab_size * model.dim


def training_flops_per_token(model: Shape, *, seq_len: int, recompute: str = "none") -> float:
    """FLOPs executed per token in one training step, recomputation included.

    full: every layer's forward runs twice, so the layer part (1/3 forward, 2/3 backward) grows
    by 4/3; for GPTShape this is exactly Megatron's 96·l·h²·(1 + s/(6h) + V/(16·l·h)).
    selective: only the attention core (QKᵀ and AV, 4·s·h per layer per token) is redone.
    """
    base = model.flops_per_token(seq_len)
    if recompute == "none":
        return float(base)
    if recompute == "selective":
        return float(base + 4 * model.n_layers * model.dim * seq_len)
    if recompute == "full":
        layers = base - head_flops_per_token(model)
        return layers * 4 / 3 + head_flops_per_token(model)
    raise ValueError(f"recompute={recompute!r} must be one of 'none', 'selective', 'full'")


def block_params(model: Shape) -> int:
    """Parameters of all blocks, routed experts excluded (plan.experts places those)."""
    if not is_moe(model):
        return model.n_layers * model.layer_params()
    return sum(model.layer_params(i) for i in range(model.n_layers)) - expert_params(model)


def fp8_flops_per_token(model: Shape, *, recompute: str = "none") -> float:
    """The part of `training_flops_per_token` that FP8 linears run in float8: the block
    linears (every matmul weight but the output head, which train.fp8_skip keeps in bf16;
    not the attention core), 4/3 of it with full recomputation (their forward runs twice)."""
    attention = 12 * model.n_layers * model.dim  # per attended key, seq_len = 1 below
    linears = model.flops_per_token(1) - attention - head_flops_per_token(model)
    return float(linears * 4 / 3 if recompute == "full" else linears)


def rank_params(model: Shape, *, tp: int = 1, pp: int = 1) -> float:
    """Ψ for the busiest (tp, pp) shard: the dense parameters one rank holds before ZeRO
    (routed experts are not tp-sharded and live 1/ep per rank: `experts.rank_expert_params`).

    Layers are split evenly over pp and every weight over tp (LayerNorm/RMSNorm weights are
    really replicated across tp; they are < 0.1% of a layer, so this overcounts nothing that
    matters). The non-layer parameters E (embeddings, head, final norm) sit on the end stages:
    with pp = 1 all of E is on the rank; with pp > 1 the first stage holds the embedding and the
    last the head, so the busier end holds E/2 when untied, and all of E when tied (Megatron
    keeps a copy of the tied word embedding on the last stage).
    """
    layers = block_params(model)
    extra = model.num_params() - layers - expert_params(model)
    if pp > 1 and not model.tied_embeddings:
        extra /= 2
    return (layers / pp + extra) / tp

"""Exact per-rank model-state bytes of the flat data-parallel engine (hpctrain.parallel.data).

The ZeRO formulas of `hpctrain.plan.memory` count Ψ parameters. The engine lays parameters
into flat units, and each unit's layout pads Ψᵤ to dp·Sᵤ (S = ceil(Ψᵤ/dp), see
`hpctrain.parallel.data.layout.ShardLayout`). Per unit, with p bytes per compute element
(2 for bf16/fp16, 4 for fp32) and Pᵤ = dp·Sᵤ the padded size (Pᵤ = Ψᵤ when zero = 0):

  params     p·Pᵤ (full buffer, zero < 3)        p·Sᵤ (shard only, zero 3, between steps)
  grads      p·Pᵤ (full bucket, zero < 2)        p·Sᵤ (grad shard, zero ≥ 2)
  optimizer  12·Sᵤ mixed (fp32 master, m, v)     8·Sᵤ fp32 (m, v; the shard is the master)

Units are the engine's: for zero < 3, consecutive groups of ≈ parallel.bucket_mb in reverse
registration order (`hpctrain.parallel.data.ddp.size_groups`); for zero 3, one unit for the
non-block parameters and one per transformer block. Parameter shapes come from ModelConfig,
so this stays analytical: no model is built.
"""

from __future__ import annotations

from hpctrain.models.config import ModelConfig
from hpctrain.parallel.data.layout import ShardLayout
from hpctrain.plan.memory import ModelStates


def block_numels(model: ModelConfig) -> list[int]:
    """Parameter sizes of one Block in registration order: attn_norm, wq, wk, wv, wo,
    mlp_norm, w1, w3, w2 (see hpctrain.models.llama)."""
    d, f = model.dim, model.ffn_dim
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    return [d, q * d, kv * d, kv * d, d * q, d, f * d, f * d, d * f]


def param_groups(model: ModelConfig) -> tuple[list[int], list[list[int]], list[int]]:
    """(embedding, per-block sizes, after-blocks sizes: final norm and an untied head).
    Dense models only: routed experts are placed by `hpctrain.plan.experts`."""
    if model.moe.enabled:
        raise ValueError(f"model.moe.num_experts={model.moe.num_experts}: the flat engine's "
                         "expert units are not modelled element by element; use "
                         "hpctrain.plan.memory.rank_state_bytes for a model with experts")
    tail = [model.dim] + ([] if model.tied_embeddings else [model.vocab_size * model.dim])
    blocks = [block_numels(model) for _ in range(model.n_layers)]
    return [model.vocab_size * model.dim], blocks, tail


def unit_numels(model: ModelConfig, *, zero: int, bucket_mb: float,
                elem_bytes: int) -> list[tuple[int, ...]]:
    """Parameter sizes of every flat unit, as `hpctrain.parallel.data.engine` groups them."""
    embed, blocks, tail = param_groups(model)
    if zero == 3:
        return [tuple(embed + tail)] + [tuple(b) for b in blocks]
    named = embed + [n for b in blocks for n in b] + tail
    bucket_bytes, units, size = bucket_mb * 2**20, [[]], 0
    for n in reversed(named):  # the same rule as ddp.size_groups
        if units[-1] and size + n * elem_bytes > bucket_bytes:
            units.append([])
            size = 0
        units[-1].append(n)
        size += n * elem_bytes
    return [tuple(u) for u in units if u]


def flat_state_bytes(model: ModelConfig, *, dp: int, zero: int, precision: str,
                     bucket_mb: float = 25.0, offload: str = "none") -> ModelStates:
    """Bytes the engine's ledger reports on one rank between steps (module docstring)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero} must be one of 0, 1, 2, 3")
    p = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    params = grads = optim = 0
    for numels in unit_numels(model, zero=zero, bucket_mb=bucket_mb, elem_bytes=p):
        lay = ShardLayout(numels, n_shards=dp if zero >= 1 else 1)
        s, full = lay.shard_size, lay.padded_numel
        params += p * (s if zero == 3 else full)
        grads += p * (s if zero >= 2 else full)
        optim += k * s
    if offload == "cpu":
        return ModelStates(float(params), float(grads), 0.0, host=float(optim))
    return ModelStates(float(params), float(grads), float(optim))

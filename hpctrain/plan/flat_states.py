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

Under tp and pp the engine works the same way on the parameters a rank holds
(`rank_param_groups`): its tp slices (hpctrain.parallel.tensor.plan: column and row weights
1/t, the embedding and head vocab-parallel 1/t, key/value projections 1/t or one whole kv
head when kv heads < tp, norms whole) of its pipeline chunks' blocks, the embedding on the
rank holding the first chunk and the final norm + head on the one holding the last (with tied
embeddings on two ranks, the head's rank keeps a copy: hpctrain.parallel.pipeline.tied).
The busiest pipeline rank is reported.
"""

from __future__ import annotations

from hpctrain.models.config import ModelConfig
from hpctrain.parallel.data.layout import ShardLayout
from hpctrain.plan.memory import ModelStates


def block_numels(model: ModelConfig, *, tp: int = 1) -> list[int]:
    """Parameter sizes of one Block on a tp rank, in registration order: attn_norm, wq, wk,
    wv, wo, mlp_norm, w1, w3, w2 (see hpctrain.models.llama; module docstring for tp)."""
    d, f, hd = model.dim, model.ffn_dim, model.head_dim
    q = model.n_heads * hd
    kv = model.n_kv_heads * hd // tp if model.n_kv_heads % tp == 0 else hd
    return [d, q * d // tp, kv * d, kv * d, d * q // tp, d, f * d // tp, f * d // tp,
            d * f // tp]


def param_groups(model: ModelConfig, *, tp: int = 1) -> tuple[list[int], list[list[int]],
                                                               list[int]]:
    """(embedding, per-block sizes, after-blocks sizes: final norm and an untied head) on a
    tp rank. Dense models only: routed experts are placed by `hpctrain.plan.experts`."""
    if model.moe.enabled:
        raise ValueError(f"model.moe.num_experts={model.moe.num_experts}: the flat engine's "
                         "expert units are not modelled element by element; use "
                         "hpctrain.plan.memory.rank_state_bytes for a model with experts")
    vocab = model.vocab_size * model.dim // tp
    tail = [model.dim] + ([] if model.tied_embeddings else [vocab])
    blocks = [block_numels(model, tp=tp) for _ in range(model.n_layers)]
    return [vocab], blocks, tail


def rank_chunks(pp_rank: int, *, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The pipeline chunks (stage ids) pp rank `pp_rank` holds: every pp-th one, or the V of
    zbv (chunks r and 2·pp − 1 − r)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual_stages)]


def rank_param_groups(model: ModelConfig, *, tp: int = 1, pp: int = 1, virtual_stages: int = 1,
                      schedule: str = "1f1b", pp_rank: int = 0):
    """`param_groups` of the parameters pp rank `pp_rank` holds (module docstring)."""
    embed, blocks, tail = param_groups(model, tp=tp)
    n = pp * virtual_stages
    per = model.n_layers // n
    chunks = rank_chunks(pp_rank, pp=pp, virtual_stages=virtual_stages, schedule=schedule)
    mine = [b for c in sorted(chunks) for b in blocks[c * per:(c + 1) * per]]
    first, last = 0 in chunks, n - 1 in chunks
    if last and not first and model.tied_embeddings:  # the head's copy of E
        tail = tail + embed
    return embed if first else [], mine, tail if last else []


def unit_numels(model: ModelConfig, *, zero: int, bucket_mb: float, elem_bytes: int,
                held=None) -> list[tuple[int, ...]]:
    """Parameter sizes of every flat unit, as `hpctrain.parallel.data.engine` groups them
    (`held`: the parameters a rank holds, `rank_param_groups`; default the whole model's)."""
    embed, blocks, tail = held or param_groups(model)
    if zero == 3:
        ends = [tuple(embed + tail)] if embed or tail else []  # a middle stage has none
        return ends + [tuple(b) for b in blocks]
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
                     bucket_mb: float = 25.0, offload: str = "none", tp: int = 1, pp: int = 1,
                     virtual_stages: int = 1, schedule: str = "1f1b",
                     pp_rank: int | None = None) -> ModelStates:
    """Bytes the engine's ledger reports between steps on the busiest rank of a layout
    (module docstring), or on pipeline rank `pp_rank`."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero} must be one of 0, 1, 2, 3")
    # every pp rank holds as many blocks; the ends add the embedding and the head
    ranks = [_rank_states(model, dp=dp, zero=zero, precision=precision, bucket_mb=bucket_mb,
                          offload=offload, held=rank_param_groups(
                              model, tp=tp, pp=pp, virtual_stages=virtual_stages,
                              schedule=schedule, pp_rank=r))
             for r in ([pp_rank] if pp_rank is not None else sorted({0, pp - 1}))]
    return max(ranks, key=lambda s: s.total + s.host)


def _rank_states(model, *, dp, zero, precision, bucket_mb, offload, held) -> ModelStates:
    p = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    params = grads = optim = 0
    for numels in unit_numels(model, zero=zero, bucket_mb=bucket_mb, elem_bytes=p,
                              held=held):
        lay = ShardLayout(numels, n_shards=dp if zero >= 1 else 1)
        s, full = lay.shard_size, lay.padded_numel
        params += p * (s if zero == 3 else full)
        grads += p * (s if zero >= 2 else full)
        optim += k * s
    if offload == "cpu":
        return ModelStates(float(params), float(grads), 0.0, host=float(optim))
    return ModelStates(float(params), float(grads), float(optim))

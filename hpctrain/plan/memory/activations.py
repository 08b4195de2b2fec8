"""Activation bytes of hpctrain's own Llama blocks: what autograd saves, tensor by tensor.

`plan.memory` keeps Korthikanti et al.'s GPT table for Megatron's shapes; this module counts
what `hpctrain.models.llama.model` saves for backward, so a run's predicted activation and peak
memory can be checked against `hpctrain.metrics.activations.ActivationMeter` (the same quantity,
measured). Per token of a microbatch (T = b·s/cp tokens), e = activation element bytes (4 in
fp32; 2 for the matmul outputs under bf16/fp16 autocast, whose norms still compute in fp32),
h model width, K·d key/value width, N heads, f MLP width, t tp:

  RMSNorm (×2)   input x in fp32 (4h), fp32 normalised y (4h), rstd (4), output (e·h). Under
                 sequence parallelism the norm runs on T/t tokens and only the all-gathered
                 output its column linears read is saved (e·h a token of the whole sequence,
                 once for q/k/v or w1/w3: the gather returns it contiguous); the MoE block's
                 norm output stays a shard (its router reads the shard)
  attention      q and the output (e·h/t each), k and v after RoPE (e·K·d/t each), the fp32
                 log-sum-exp (4·N/t); a fused backend keeps no L×L matrix; eager adds the
                 probabilities and scores (2·e·N/t·s per token)
  SwiGLU         w1 and w3 outputs, silu(w1), their product (4·e·f/t)
  RoPE           cos and sin cast to e for q and for k (4·e·d): per token with packed
                 documents (positions differ by row) and under cp (a zigzag shard's positions
                 are taken per row), per position of a row without
  full recompute only each layer's input (e·h, /t under sp), plus the largest block's set
                 while it is rerun in its backward (then the head's log-softmax of that
                 microbatch is already freed; in fp32 the block's first norm keeps the stored
                 input itself, so that input counts once)
A mixture-of-experts block (hpctrain.models.moe.layer) replaces the SwiGLU by, per token it routes
(all T under tp, T/t under sp, whose MoE block runs on the sequence shard with no gathered
norm input), E experts, k' expert slots per token (top_k dropless, an upper bound of
capacity_factor·top_k with a capacity), f_e expert width, s shared experts:
  router         fp32 logits and scores (8·E), the top-k scores and ids (12·k), lse and the
                 gate sum (8); under 16 bits its input's fp32 cast (4·h) in place of the
                 norm's output (−e·h: nothing else in the block keeps it), and its weight's
                 fp32 cast (4·E·h a block and microbatch: left out, < 0.01% at real sizes)
  per slot       the dispatched row, the expert output and its gate-weighted copy that the
                 combine's index_add keeps (3·e·h), the expert's SwiGLU (4·e·f_e), its token
                 id, kept-slot id and gate (20); with ep > 1 the received rows' order and its
                 inverse (16). The slots are counted at the bound the dry run routes
                 (hpctrain.models.moe.router.bound_routing): a rank receives its own count, as under
                 uniform routing (routing is data-dependent)
  shared         4·e·s·f_e
Outside the layers, on the first stage: the token ids (8 bytes); on the last stage: the final
norm (as above), the loss's fp32 log-softmax (4·V/t; the logits themselves are not kept) and the
targets (8). The busiest stage
is the larger of the first (most microbatches in flight) and the last (the head).
"""

from __future__ import annotations

from collections.abc import Callable

from hpctrain.models.config import ModelConfig
from hpctrain.plan.experts import routed_copies


def _norm(h: float, e: int) -> float:
    """RMSNorm: its input in fp32 (a copy under 16 bits), the fp32 normalised y, the rstd,
    and its output in the activation dtype (saved by the next linear)."""
    return 8 * h + e * h + 4


def _entry_norm(h: float, e: int, *, t: int, sp: bool) -> float:
    """A norm whose output enters tensor-parallel column linears, per token of the micro-batch:
    `_norm`, or under sp its fp32 tensors on T/t tokens and the gathered output (module doc)."""
    if sp and t > 1:
        return (_norm(h, e) - e * h) / t + e * h
    return _norm(h, e)


def layer_bytes_per_token(model: ModelConfig, *, seq_len: int, tp: int, sp: bool,
                          precision: str, moe_block: bool = False, ep: int = 1) -> float:
    """Saved bytes of one block per token of a microbatch, no recomputation (module doc);
    `moe_block`: a block whose MLP is the mixture of experts."""
    e = 4 if precision == "fp32" else 2
    h, n, f, t = model.dim, model.n_heads, model.ffn_dim, tp
    kv = model.n_kv_heads * model.head_dim
    mlp_norm = _norm(h, e) / (t if sp else 1) if moe_block else _entry_norm(h, e, t=t, sp=sp)
    norms = _entry_norm(h, e, t=t, sp=sp) + mlp_norm
    attn = e * (2 * h + 2 * kv) / t + 4 * n / t
    if getattr(model, "attention", "sdpa") == "eager":
        attn += 2 * e * n / t * seq_len
    if moe_block:
        return norms + attn + moe_bytes_per_token(model, precision=precision, ep=ep) / (
            t if sp else 1)
    return norms + attn + 4 * e * f / t


def moe_bytes_per_token(model: ModelConfig, *, precision: str, ep: int = 1) -> float:
    """Saved bytes of one mixture-of-experts MLP per token it routes (module doc)."""
    e = 4 if precision == "fp32" else 2
    m, h, f = model.moe, model.dim, model.expert_ffn_dim
    slots = routed_copies(model)
    router = 8 * m.num_experts + 12 * m.top_k + 8 + (0 if e == 4 else (4 - e) * h)
    per_slot = 3 * e * h + 4 * e * f + 20 + (16 if ep > 1 else 0)
    return router + slots * per_slot + 4 * e * m.shared_experts * f


def mean_layer_bytes_per_token(model: ModelConfig, **kw) -> tuple[float, float]:
    """(mean, largest) saved bytes per token of the model's blocks, dense and MoE
    (`layer_bytes_per_token`); a stage's blocks are taken as the model's mix."""
    dense = layer_bytes_per_token(model, **kw)
    if not model.moe.enabled:
        return dense, dense
    moe = layer_bytes_per_token(model, moe_block=True, **kw)
    share = model.n_moe_layers / model.n_layers
    return (1 - share) * dense + share * moe, max(dense, moe)


def stage_activation_bytes(model: ModelConfig, **kw) -> dict[str, float]:
    """Peak saved bytes on the first and on the last pipeline stage (the same stage when
    pp = 1): `rank_activation_bytes`' ends."""
    ranks = rank_activation_bytes(model, **kw)
    return {"first": ranks[0], "last": ranks[-1]}


def rank_activation_bytes(model: ModelConfig, *, seq_len: int, micro_batch_size: int,
                          tp: int, sp: bool, pp: int, layers_per_chunk: float,
                          recompute: str, precision: str, ep: int = 1, chunks: int = 1,
                          packed: bool = True, in_flight: tuple[int, ...] | None = None,
                          head_rank: int | None = None,
                          stage_peaks: Callable[[Callable[[int], float]], tuple[float, ...]]
                          | None = None) -> list[float]:
    """Peak saved bytes on each pipeline rank, first to last, of `chunks` model chunks per
    rank (virtual stages). `stage_peaks`: the schedule's peaks given each stage's set bytes
    (`plan.bubble.weighted_peaks`), exact. Or `in_flight`: (microbatch, chunk) sets alive at
    the peak of each pipeline rank, each a set of the mean stage, the head's rank
    (`head_rank`, default the last) holding ceil(in_flight / chunks) heads."""
    e = 4 if precision == "fp32" else 2
    tokens = micro_batch_size * seq_len
    mean, largest = mean_layer_bytes_per_token(model, seq_len=seq_len, tp=tp, sp=sp,
                                               precision=precision, ep=ep)
    rope = 4 * e * model.head_dim * (tokens if packed else seq_len)
    per_layer, recomputed = tokens * mean + rope, tokens * largest + rope
    block_input = tokens * e * model.dim / (tp if sp else 1)
    if recompute == "full":  # layer inputs, plus the layer being recomputed
        one_set, transient = layers_per_chunk * block_input, recomputed
    else:
        one_set, transient = layers_per_chunk * per_layer, 0.0
    ids = tokens * 8  # the token ids, on the embedding's stage
    # the head's stage keeps each microbatch's log-softmax until its backward, like its layers
    head = tokens * (_entry_norm(model.dim, e, t=tp, sp=sp) + 4 * model.vocab_size / tp + 8)
    if stage_peaks is not None:
        last = pp * chunks - 1
        kw = dict(seq_len=seq_len, tp=tp, sp=sp, precision=precision, ep=ep)
        block = {moe: tokens * layer_bytes_per_token(model, moe_block=moe, **kw) + rope
                 for moe in {model.is_moe_layer(i) for i in range(model.n_layers)}}

        def blocks(stage: int) -> list[float]:  # its own, dense or mixture of experts
            lo, hi = round(stage * layers_per_chunk), round((stage + 1) * layers_per_chunk)
            return [block[model.is_moe_layer(i)] for i in range(lo, hi)] or [0.0]

        def stage_bytes(stage: int) -> float:
            sets = one_set if recompute == "full" else sum(blocks(stage))
            return sets + (ids if stage == 0 else 0.0) + (head if stage == last else 0.0)

        def rerun(stage: int) -> float:  # full: the block rerun in backward, after the head's
            # backward freed it; in fp32 its first norm keeps the stored input itself
            shared = block_input if e == 4 else 0.0
            return max(blocks(stage)) - shared - (head if stage == last else 0.0)

        sets = [stage_bytes(stage) for stage in range(last + 1)]  # each once: the peaks
        reruns = [rerun(stage) for stage in range(last + 1)]  # read them per action
        return list(stage_peaks(sets.__getitem__, backward_extra=reruns.__getitem__
                                if recompute == "full" else None))
    if in_flight is None:
        raise ValueError("rank_activation_bytes needs stage_peaks or in_flight")
    ranks = [sets * one_set + transient for sets in in_flight]
    ranks[0] += in_flight[0] * ids
    if pp == 1:
        return [ranks[0] + head]
    last = pp - 1 if head_rank is None else head_rank
    ranks[last] += -(-in_flight[last] // chunks) * head
    return ranks

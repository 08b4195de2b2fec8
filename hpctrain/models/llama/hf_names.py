"""Where each hpctrain weight lives in a Hugging Face model directory.

hpctrain's Transformer equals transformers' Llama, Mistral, Qwen2, Qwen3 and Mixtral models
through a pure renaming of weights (rotate-half RoPE on both sides, RMSNorm and SwiGLU alike),
with one reshaping: hpctrain stacks a layer's routed experts into one tensor per projection,
`layers.<i>.mlp.experts.w{1,2,3}` of shape [E, in, out], where Mixtral stores each expert's
Linear weight, [out, in]: hpctrain's `w[e]` is Mixtral's `experts.<e>.w.weight` transposed.
A tied output head (`tie_word_embeddings`) that a directory does not hold is its embedding.

`hf_tensors` writes a weight as the tensors that hold it; `hf_pieces` says where any box of a
weight is read from, so an import reads a rank's own box and nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# hpctrain name pattern → Hugging Face name (per block: layers.<i>.).
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "block_sparse_moe.gate.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(w[123])")
TIED_SOURCE = "model.embed_tokens.weight"  # what a tied head reads when lm_head is absent


def expert_stack(name: str) -> tuple[int, str] | None:
    """(layer, projection) when `name` is a stacked routed-expert weight, else None."""
    m = _EXPERTS.fullmatch(name)
    return None if m is None else (int(m[1]), m[2])


def hf_expert_name(layer: int, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{projection}.weight"


def hf_weight_name(name: str) -> str:
    """The Hugging Face name of hpctrain weight `name` (not a stacked expert weight: those are
    one tensor per expert, `hf_expert_name`)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m[2] not in _BLOCK:
        raise KeyError(f"hpctrain weight {name!r} has no Hugging Face counterpart")
    return f"model.layers.{m[1]}.{_BLOCK[m[2]]}"


def hf_tensors(name: str, value) -> dict:
    """hpctrain weight `name` = `value` as the Hugging Face tensors that hold it."""
    stack = expert_stack(name)
    if stack is None:
        return {hf_weight_name(name): value}
    layer, w = stack
    return {hf_expert_name(layer, e, w): value[e].t().contiguous()
            for e in range(value.shape[0])}


@dataclass(frozen=True)
class Piece:
    """Part of an hpctrain weight's box held by one Hugging Face tensor: `hf` (full shape
    `shape`) at its box `box`, for the whole box (`row` None), or transposed for the box's row
    `row` of a stacked expert weight."""

    hf: str
    shape: tuple[int, ...]
    box: tuple[slice, ...]
    row: int | None = None


def hf_pieces(name: str, shape: tuple[int, ...], box: tuple[slice, ...], *,
              holds: Callable[[str], bool]) -> list[Piece]:
    """Where box `box` of hpctrain weight `name` (full shape `shape`) lives in a directory
    whose tensors `holds` tells: one tensor's same box, or for a stacked expert weight
    [E, in, out] each expert of box[0] as the [out, in] box of its own tensor, transposed."""
    stack = expert_stack(name)
    if stack is None:
        hf = hf_weight_name(name)
        if hf == _TOP["output.weight"] and not holds(hf):
            hf = TIED_SOURCE  # tied: the head is the embedding
        return [Piece(hf, tuple(shape), tuple(box))]
    layer, projection = stack
    first = box[0].start or 0
    return [Piece(hf_expert_name(layer, e, projection), (shape[2], shape[1]), (box[2], box[1]),
                  row=e - first) for e in range(first, box[0].stop)]


def whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    """The box of a whole tensor of `shape`."""
    return tuple(slice(0, n) for n in shape)

"""A Hugging Face model directory as hpctrain's model: its config.json as `model.*` keys, and
each hpctrain weight's name in its safetensors.

hpctrain's Transformer equals transformers' `LlamaForCausalLM` (and `MistralForCausalLM`
without a sliding window) through a pure renaming of weights (`hf_weight_name`; rotate-half
RoPE on both sides, RMSNorm and SwiGLU alike), so an import is a renaming plus the shape
below. An export writes a Llama directory (a Mistral without sliding window is one).
Everything in a config.json that would change what the model computes and that hpctrain does
not implement is refused, naming field and value (`unsupported`), before any rank starts.
Nothing here needs transformers.

With `model.init_from=<dir>` the shape comes from `<dir>/config.json` (`resolve_init_from`):
a `model.*` key still at its schema default takes the file's value; one set to anything else
must agree with it, except `max_seq_len`, which may be shorter than the file's
`max_position_embeddings` (a shorter RoPE table, the same weights).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hpctrain.models.config import ModelConfig

FAMILIES = ("llama", "mistral")  # Mistral: Llama's modules and names, sliding_window null
MISSING = "???"  # OmegaConf's missing value

# hpctrain name pattern → Hugging Face name (per block: layers.<i>.).
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def hf_weight_name(name: str) -> str:
    """The Hugging Face (LlamaForCausalLM) name of hpctrain weight `name`."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m[2] not in _BLOCK:
        raise KeyError(f"hpctrain weight {name!r} has no Hugging Face counterpart")
    return f"model.layers.{m[1]}.{_BLOCK[m[2]]}"


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """`<directory>/config.json` as a dict; ValueError naming the path when it is missing."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.init_from={directory}: {path} does not exist: give a local "
                         "Hugging Face model directory (config.json + *.safetensors)")
    return json.loads(path.read_text())


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(θ, the scaling dict or None) from transformers ≥ 5 (`rope_parameters`) or 4
    (`rope_theta` + `rope_scaling`) configs."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (None if kind == "default" else {**scaling, "rope_type": kind})


def unsupported(hf: dict[str, Any]) -> list[str]:
    """`field=value` of each config.json setting that would take effect and that hpctrain does
    not implement ([] when the model imports exactly)."""
    bad = []
    if hf.get("model_type") not in FAMILIES:
        bad.append(f"model_type={hf.get('model_type')!r} (supported: {', '.join(FAMILIES)})")
    checks = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "attention_dropout": 0.0, "pretraining_tp": 1, "quantization_config": None,
              "sliding_window": None}
    for key, ok in checks.items():
        if key in hf and hf[key] != ok and not (key == "pretraining_tp" and hf[key] is None):
            bad.append(f"{key}={hf[key]!r} (hpctrain: {ok!r})")
    heads, dim = hf.get("num_attention_heads", 1), hf.get("hidden_size", 0)
    if hf.get("head_dim") not in (None, dim // heads) or dim % heads:
        bad.append(f"head_dim={hf.get('head_dim')!r} with hidden_size={dim}, "
                   f"num_attention_heads={heads} (hpctrain: head_dim = hidden_size / heads)")
    _, scaling = _rope(hf)
    if scaling is not None and scaling["rope_type"] != "llama3":
        bad.append(f"rope_type={scaling['rope_type']!r} (hpctrain: default or llama3)")
    elif scaling is not None and scaling.get("attention_factor") not in (None, 1.0):
        bad.append(f"attention_factor={scaling['attention_factor']!r} (hpctrain: 1.0)")
    return bad


def model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as `model.*` values (transformers' defaults where a key is absent)."""
    theta, scaling = _rope(hf)
    out = {"vocab_size": hf["vocab_size"], "dim": hf["hidden_size"],
           "n_layers": hf["num_hidden_layers"], "n_heads": hf["num_attention_heads"],
           "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
           "ffn_dim": hf["intermediate_size"],
           "max_seq_len": hf.get("max_position_embeddings", 2048), "rope_theta": theta,
           "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
           "tied_embeddings": bool(hf.get("tie_word_embeddings", False))}
    out["rope_scaling"] = {"type": "none"}
    if scaling is not None:
        out["rope_scaling"] = {
            "type": "llama3", "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_seq_len": int(scaling["original_max_position_embeddings"])}
    return out


def resolve_init_from(raw: dict[str, Any], *,
                      defaults: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The `model` group with `init_from`'s shape filled in, and the problems (each names the
    key, both values and the fix). `defaults` are the schema's (a key at its default is
    unset); keys without a default are unset when absent or `???`."""
    directory = raw.get("init_from")
    unset = [key for key, value in raw.items() if value == MISSING]
    if not directory:
        return raw, [] if not unset else [
            f"model.{', model.'.join(unset)} unset: model=hf needs the directory, "
            "model.init_from=<a local Hugging Face model directory> (config.json + "
            "*.safetensors)"]
    try:
        hf = read_hf_config(directory)
    except ValueError as err:
        return raw, [str(err)]
    bad = unsupported(hf)
    if bad:
        return raw, [f"model.init_from={directory}: config.json sets what hpctrain does not "
                     f"implement: {'; '.join(bad)}; convert the model or choose another"]
    out, problems = dict(raw), []
    if raw.get("moe", defaults.get("moe")) != defaults.get("moe"):
        problems.append(f"model.moe.* is set, but model.init_from={directory} is a dense "
                        f"{hf.get('model_type')} model: drop the model.moe.* keys")
    for key, value in model_keys(hf).items():
        given = raw.get(key, MISSING)
        if given in (MISSING, defaults.get(key, MISSING)) or given == value:
            out[key] = value
        elif key == "max_seq_len" and isinstance(given, int) and 0 < given < value:
            continue  # a shorter context: a shorter RoPE table, the same weights
        else:
            problems.append(
                f"model.{key}={given!r} contradicts model.init_from={directory}, whose "
                f"config.json gives {value!r}: the shape comes from config.json, so drop "
                f"model.{key} (a model preset sets it: use model=hf)")
    if out.get("name", MISSING) == MISSING:
        out["name"] = Path(directory).name
    return out, problems


def hf_config(m: ModelConfig, *, dtype: str) -> dict[str, Any]:
    """The Llama config.json of model `m` (the inverse of `model_keys`): RoPE written both as
    transformers ≥ 5 reads it (`rope_parameters`) and as 4.x does (`rope_theta`,
    `rope_scaling`)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling.type == "llama3":
        s = m.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_seq_len)
    scaling = None if rope["rope_type"] == "default" else {
        k: v for k, v in rope.items() if k != "rope_theta"}
    name = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": m.vocab_size, "hidden_size": m.dim, "intermediate_size": m.ffn_dim,
            "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
            "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "tie_word_embeddings": m.tied_embeddings,
            "rope_parameters": rope, "rope_theta": m.rope_theta, "rope_scaling": scaling,
            "dtype": name, "torch_dtype": name}

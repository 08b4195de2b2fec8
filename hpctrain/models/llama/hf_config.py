"""A Hugging Face model directory's config.json as hpctrain's model shape, and back.

Families (`model_type`): llama, mistral (without a sliding window), qwen2 (q/k/v biases),
qwen3 (per-head q/k RMSNorm, its own head_dim) and mixtral (routed experts in every block).
hpctrain's model equals each through a pure renaming of weights (`hf_names`). Everything in a
config.json that would change what the model computes and that hpctrain does not implement is
refused, naming field and value (`unsupported`), before any rank starts. Nothing here needs
transformers. An export writes the family the shape needs (`export_family`).

With `model.init_from=<dir>` the shape comes from `<dir>/config.json` (`resolve_init_from`):
a `model.*` key still at its schema default takes the file's value; one set to anything else
must agree with it, except `max_seq_len`, which may be shorter than the file's
`max_position_embeddings` (a shorter RoPE table, the same weights), and the routed experts'
training settings (`model.moe.aux_loss_coef`, `z_loss_coef`, `capacity_factor`): a Mixtral's
own (its `router_aux_loss_coef`, no z-loss, dropless) unless the run sets them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.errors import read_json
from hpctrain.models.config import ModelConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral")
MISSING = "???"  # OmegaConf's missing value
# transformers' defaults for keys a config.json may leave out, where the families differ
_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 128},
    "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5},
}
MOE_TRAINING = ("aux_loss_coef", "z_loss_coef", "capacity_factor")  # a run may set them


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """`<directory>/config.json` as a dict; ValueError naming the path when it is missing."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"model.init_from={directory}: {path} does not exist: give a local "
                         "Hugging Face model directory (config.json + *.safetensors)")
    return read_json(path, fix="download or save the model directory again")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(θ, the scaling dict or None) from transformers ≥ 5 (`rope_parameters`) or 4
    (`rope_theta` + `rope_scaling`) configs."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (None if kind == "default" else {**scaling, "rope_type": kind})


def _family(hf: dict[str, Any]) -> str:
    return hf.get("model_type", "")


def _head_dim(hf: dict[str, Any]) -> int:
    """config.json's head_dim, or its family's default (hidden_size / heads; Qwen3: 128)."""
    given = hf.get("head_dim")
    if given is not None:
        return int(given)
    default = _DEFAULTS.get(_family(hf), {}).get("head_dim")
    return default or hf.get("hidden_size", 0) // max(hf.get("num_attention_heads", 1), 1)


def _sliding(hf: dict[str, Any]) -> list[str]:
    """The sliding-window settings that take effect (Qwen configs always carry a
    `sliding_window`, used only with `use_sliding_window`; Mistral and Mixtral use it when set)."""
    if _family(hf).startswith("qwen"):
        bad = [f"use_sliding_window=True (sliding_window={hf.get('sliding_window')!r})"
               ] if hf.get("use_sliding_window") else []
        kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
        return bad + [f"layer_types with {sorted(kinds)}"] if kinds else bad
    return [] if hf.get("sliding_window") is None else [
        f"sliding_window={hf['sliding_window']!r}"]


def unsupported(hf: dict[str, Any]) -> list[str]:
    """`field=value` of each config.json setting that would take effect and that hpctrain does
    not implement ([] when the model imports exactly)."""
    family = _family(hf)
    if family not in FAMILIES:
        return [f"model_type={hf.get('model_type')!r} (supported: {', '.join(FAMILIES)})"]
    checks: dict[str, Any] = {"hidden_act": "silu", "mlp_bias": False, "attention_dropout": 0.0,
                              "pretraining_tp": 1, "quantization_config": None}
    if family != "qwen2":  # Llama's and Qwen3's attention_bias also bias o_proj
        checks["attention_bias"] = False
    if family == "mixtral":
        checks.update(router_jitter_noise=0.0)
    bad = [f"{key}={hf[key]!r} (hpctrain: {ok!r})" for key, ok in checks.items()
           if key in hf and hf[key] != ok and not (key == "pretraining_tp" and hf[key] is None)]
    bad += [f"{item} (hpctrain: full attention in every layer)" for item in _sliding(hf)]
    if _head_dim(hf) % 2:
        bad.append(f"head_dim={_head_dim(hf)} (hpctrain: even, RoPE rotates pairs)")
    _, scaling = _rope(hf)
    if scaling is not None and scaling["rope_type"] != "llama3":
        bad.append(f"rope_type={scaling['rope_type']!r} (hpctrain: default or llama3)")
    elif scaling is not None and scaling.get("attention_factor") not in (None, 1.0):
        bad.append(f"attention_factor={scaling['attention_factor']!r} (hpctrain: 1.0)")
    return bad


def model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as `model.*` values (transformers' defaults where a key is absent)."""
    theta, scaling = _rope(hf)
    family, defaults = _family(hf), _DEFAULTS.get(_family(hf), _DEFAULTS["llama"])
    out = {"vocab_size": hf["vocab_size"], "dim": hf["hidden_size"],
           "n_layers": hf["num_hidden_layers"], "n_heads": hf["num_attention_heads"],
           "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
           "ffn_dim": hf["intermediate_size"], "head_dim": _head_dim(hf),
           "max_seq_len": hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
           "rope_theta": theta,
           "norm_eps": float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
           "tied_embeddings": bool(hf.get("tie_word_embeddings", False)),
           "attention_bias": family == "qwen2",  # others' are refused (`unsupported`)
           "qk_norm": family == "qwen3"}
    out["rope_scaling"] = {"type": "none"}
    if scaling is not None:
        out["rope_scaling"] = {
            "type": "llama3", "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_seq_len": int(scaling["original_max_position_embeddings"])}
    if family == "mixtral":  # experts of intermediate_size in every block, softmax top-k
        out["moe"] = {"num_experts": hf["num_local_experts"],
                      "top_k": hf.get("num_experts_per_tok", 2), "every": 1,
                      "shared_experts": 0, "expert_ffn_dim": 0, "router": "softmax",
                      # how Mixtral was trained: defaults a run may change (MOE_TRAINING)
                      "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.02)),
                      "z_loss_coef": 0.0}
    return out


def _moe_problems(given: Any, value: dict[str, Any] | None, defaults: dict[str, Any],
                  directory: str) -> tuple[dict[str, Any] | Any, list[str]]:
    """The model.moe group with the file's experts filled in, and its contradictions."""
    given = given if isinstance(given, dict) else {}
    if value is None:  # a dense model: only the defaults may be given
        set_keys = [k for k, v in given.items() if v != defaults.get(k)]
        return given or defaults, [] if not set_keys else [
            f"model.moe.{', model.moe.'.join(set_keys)} set, but model.init_from={directory} "
            "is a dense model: drop the model.moe.* keys"]
    out, problems = {**defaults, **given}, []
    for key, file_value in value.items():
        now = given.get(key, defaults.get(key))
        if now in (defaults.get(key), file_value):
            out[key] = file_value
        elif key in MOE_TRAINING:  # the run's own choice
            out[key] = now
        else:
            problems.append(f"model.moe.{key}={now!r} contradicts model.init_from={directory}, "
                            f"whose config.json gives {file_value!r}: drop model.moe.{key}")
    return out, problems


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
    keys = model_keys(hf)
    out["moe"], problems = _moe_problems(raw.get("moe"), keys.pop("moe", None),
                                         defaults.get("moe") or {}, directory)
    for key, value in keys.items():
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


def export_family(m: ModelConfig) -> tuple[str, list[str]]:
    """The Hugging Face family that holds model `m` exactly, and why none does ([] if one
    does): Mixtral for routed experts, Qwen3 for q/k norms, Qwen2 for q/k/v biases, else
    Llama."""
    moe, why = m.moe, []
    if moe.enabled:
        why += [f"model.moe.{k}={v!r} (Mixtral: {ok!r})" for k, v, ok in (
            ("every", moe.every, 1), ("shared_experts", moe.shared_experts, 0),
            ("router", moe.router, "softmax")) if v != ok]
        if m.expert_ffn_dim != m.ffn_dim:
            why.append(f"model.moe.expert_ffn_dim={moe.expert_ffn_dim} ≠ model.ffn_dim="
                       f"{m.ffn_dim} (Mixtral has one intermediate_size)")
        why += [f"model.{k}=true (Mixtral has none)" for k in ("attention_bias", "qk_norm")
                if getattr(m, k)]
        return "mixtral", why
    if m.qk_norm:
        if m.attention_bias:
            why.append("model.attention_bias=true with model.qk_norm=true (Qwen3's "
                       "attention_bias also biases o_proj, which hpctrain's attention has not)")
        return "qwen3", why
    if m.attention_bias:
        if m.head_dim != m.dim // m.n_heads or m.dim % m.n_heads:
            why.append(f"model.head_dim={m.head_dim} with q/k/v biases and no q/k norm "
                       "(Qwen2 derives head_dim = dim / n_heads)")
        return "qwen2", why
    return "llama", why


_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM"}


def model_tokenizer(init_from: str | None) -> Path | None:
    """`<init_from>/tokenizer.json` when the model directory has one (its tokenizer)."""
    path = Path(init_from).expanduser() / "tokenizer.json" if init_from else None
    return path if path is not None and path.is_file() else None


def with_model_tokenizer(data: Any, init_from: str | None) -> Any:
    """The `data` group whose tokenizer defaults to the model directory's: with
    `model.init_from` holding a tokenizer.json and no data.tokenizer_path, with data.tokenizer
    unset or `hf` (`data=jsonl`'s), data.tokenizer=hf, data.tokenizer_path=<init_from>. A
    tokenizer given (`byte`, another file) stays, for the data checks to refuse
    (hpctrain.data.checks.check_model_tokenizer)."""
    if (not isinstance(data, dict) or model_tokenizer(init_from) is None
            or data.get("tokenizer") not in (None, "hf")
            or data.get("tokenizer_path")):
        return data
    return {**data, "tokenizer": "hf", "tokenizer_path": str(init_from)}


def hf_config(m: ModelConfig, *, dtype: str) -> dict[str, Any]:
    """The config.json of model `m` in its `export_family` (the inverse of `model_keys`):
    RoPE written both as transformers ≥ 5 reads it (`rope_parameters`) and as 4.x does
    (`rope_theta`, `rope_scaling`). ValueError when no family holds `m` exactly."""
    family, why = export_family(m)
    if why:
        raise ValueError(f"model {m.name} has no exact Hugging Face form: {'; '.join(why)}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling.type == "llama3":
        s = m.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_seq_len)
    scaling = None if rope["rope_type"] == "default" else {
        k: v for k, v in rope.items() if k != "rope_theta"}
    name = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    out = {"architectures": [_ARCH[family]], "model_type": family,
           "vocab_size": m.vocab_size, "hidden_size": m.dim,
           "intermediate_size": m.expert_ffn_dim if m.moe.enabled else m.ffn_dim,
           "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
           "num_key_value_heads": m.n_kv_heads,
           # Mixtral writes null for the derived width (hidden / heads), the others a number
           "head_dim": None if family == "mixtral" and m.head_dim * m.n_heads == m.dim
           else m.head_dim,
           "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
           "hidden_act": "silu", "attention_dropout": 0.0,
           "tie_word_embeddings": m.tied_embeddings,
           "rope_parameters": rope, "rope_theta": m.rope_theta, "rope_scaling": scaling,
           "dtype": name, "torch_dtype": name}
    if family in ("llama", "qwen3"):
        out.update(attention_bias=m.attention_bias, mlp_bias=False)
    if family.startswith("qwen") or family == "mixtral":
        out.update(sliding_window=None, use_sliding_window=False)
    if family == "mixtral":
        out.update(num_local_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k,
                   router_aux_loss_coef=m.moe.aux_loss_coef, router_jitter_noise=0.0)
        out.pop("use_sliding_window")
    return out

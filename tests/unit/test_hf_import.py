"""model.init_from: a Hugging Face Llama directory becomes the run's shape and weights; hpctrain's
logits equal transformers' (fp64), and what hpctrain cannot do is refused before launch."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hpctrain.checkpoint.one_device import load_one_device
from hpctrain.models import build_model
from hpctrain.models.llama.hf_names import expert_stack, hf_expert_name, hf_weight_name
from hpctrain.ops.rope import inv_frequencies
from tests.conftest import make_config
from tests.hf_models import FAMILIES, save_tiny_llama, tiny_mistral

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _renamed(directory, model) -> dict[str, torch.Tensor]:
    """hpctrain's state dict read from `directory` by the renaming (tied head: embedding)."""
    files = safetensors_torch.load_file(directory / "model.safetensors")
    out = {}
    for name in model.state_dict():
        stack = expert_stack(name)
        if stack is not None:
            n = model.cfg.moe.num_experts
            out[name] = torch.stack([files[hf_expert_name(*stack[:1], e, stack[1])].t()
                                     for e in range(n)])
            continue
        hf = hf_weight_name(name)
        out[name] = files[hf if hf in files else "model.embed_tokens.weight"]
    return out


def _hf_in_fp64(hf, inv_freq_H2: torch.Tensor) -> None:
    """transformers computes RoPE and RMSNorm in fp32 whatever the model's dtype; for an fp64
    comparison of everything else its rotary module computes in fp64 from `inv_freq_H2`, and
    its norms run their own formula without the fp32 cast."""
    def rope(x, position_ids):
        freqs = position_ids[..., None].double() * inv_freq_H2
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def norm_of(m):
        return lambda h: m.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)
                                                    + m.variance_epsilon)

    hf.model.rotary_emb.forward = rope
    for m in hf.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = norm_of(m)


def _imported(tmp_path, *, tied: bool, dtype, hf=None):
    if hf is None:
        hf = save_tiny_llama(tmp_path, tied=tied, dtype=dtype)
    else:
        hf.save_pretrained(tmp_path)
    cfg = make_config(["model=hf", f"model.init_from={tmp_path}"], run_dir=tmp_path)
    assert (cfg.model.dim, cfg.model.tied_embeddings) == (64, tied or hf.config.tie_word_embeddings)
    model = build_model(cfg.model, seed=0).to(dtype)
    model.load_state_dict(_renamed(tmp_path, model))
    return hf, model, cfg


TOKENS = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_transformers_fp64(tmp_path, tied):
    hf, model, cfg = _imported(tmp_path, tied=tied, dtype=torch.float64)
    m = cfg.model
    assert cfg.model.rope_scaling.type == "llama3"
    ours_H2 = inv_frequencies(m.head_dim, theta=m.rope_theta, scaling=m.rope_scaling)
    # Llama 3.1 scaling: the same frequencies as transformers' (computed there in fp32)
    theirs_H2 = hf.model.rotary_emb.inv_freq.double()
    torch.testing.assert_close(ours_H2, theirs_H2, rtol=1e-6, atol=0)
    assert not torch.allclose(ours_H2, inv_frequencies(m.head_dim, theta=m.rope_theta))
    _hf_in_fp64(hf, ours_H2)
    with torch.no_grad():
        want, got = hf(TOKENS).logits, model(TOKENS)
    assert (got - want).abs().max().item() <= 1e-12


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_logits_equal_transformers_fp32(tmp_path, family):
    mistral = tiny_mistral() if family == "mistral" else None
    hf, model, _ = _imported(tmp_path, tied=mistral is None, dtype=torch.float32, hf=mistral)
    with torch.no_grad():
        want, got = hf(TOKENS).logits, model(TOKENS)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_logits_equal_transformers_fp64(tmp_path, family):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms and its head_dim of 32 where
    hidden / heads is 16: the model options model.attention_bias, qk_norm and head_dim."""
    hf, model, cfg = _imported(tmp_path, tied=False, dtype=torch.float64,
                               hf=FAMILIES[family](dtype=torch.float64))
    m = cfg.model
    assert (m.attention_bias, m.qk_norm) == (family == "qwen2", family == "qwen3")
    assert m.head_dim == (32 if family == "qwen3" else 16)
    _hf_in_fp64(hf, inv_frequencies(m.head_dim, theta=m.rope_theta))
    with torch.no_grad():
        want, got = hf(TOKENS).logits, model(TOKENS)
    assert (got - want).abs().max().item() <= 1e-12


def test_mixtral_logits_equal_transformers_fp32(tmp_path):
    """Mixtral's experts stacked per projection (transposed); its router's softmax runs in
    fp32 whatever the model's dtype, so the comparison is fp32's."""
    hf, model, cfg = _imported(tmp_path, tied=False, dtype=torch.float32, hf=FAMILIES["mixtral"]())
    m = cfg.model
    assert (m.moe.num_experts, m.moe.top_k, m.moe.every, m.expert_ffn_dim) == (4, 2, 1, 96)
    one = load_one_device(init_from=str(tmp_path)).model  # what generate and eval load
    with torch.no_grad():
        want, got = hf(TOKENS).logits, model(TOKENS)
        assert torch.equal(one(TOKENS), got)
    assert (got - want).abs().max().item() <= 1e-5


def test_a_contradicting_model_key_is_refused(tmp_path):
    save_tiny_llama(tmp_path, tied=True)
    with pytest.raises(ValueError) as err:  # model=tiny (the default) sets dim=128
        make_config([f"model.init_from={tmp_path}"], run_dir=tmp_path)
    assert "model.dim=128 contradicts model.init_from" in str(err.value)
    assert "use model=hf" in str(err.value)
    with pytest.raises(ValueError, match="model.n_heads=8 contradicts"):
        make_config(["model=hf", f"model.init_from={tmp_path}", "model.n_heads=8"],
                    run_dir=tmp_path)
    with pytest.raises(ValueError, match=r"model.moe.num_experts set, .* is a dense model"):
        make_config(["model=hf", f"model.init_from={tmp_path}", "model.moe.num_experts=4"],
                    run_dir=tmp_path)
    # a shorter context is allowed: a shorter RoPE table, the same weights
    cfg = make_config(["model=hf", f"model.init_from={tmp_path}", "model.max_seq_len=64",
                       "train.seq_len=64"],
                      run_dir=tmp_path)
    assert cfg.model.max_seq_len == 64


def test_unsupported_fields_are_refused_with_their_values(tmp_path):
    save_tiny_llama(tmp_path, tied=False)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    hf.update(attention_bias=True, head_dim=33, sliding_window=4096)
    hf["rope_parameters"]["rope_type"] = "yarn"
    path.write_text(json.dumps(hf))
    with pytest.raises(ValueError) as err:
        make_config(["model=hf", f"model.init_from={tmp_path}"], run_dir=tmp_path)
    for text in ("attention_bias=True", "sliding_window=4096", "head_dim=33",
                 "rope_type='yarn'"):
        assert text in str(err.value)


def test_qwen3_attention_bias_is_refused(tmp_path):
    """Qwen3's attention_bias biases o_proj as well, which hpctrain has not (issue 45: it was
    accepted and o_proj.bias dropped)."""
    path = tmp_path / "config.json"
    save_tiny_llama(tmp_path, tied=False)
    hf = json.loads(path.read_text())
    hf.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=True)
    path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="attention_bias=True"):
        make_config(["model=hf", f"model.init_from={tmp_path}"], run_dir=tmp_path)


def test_model_hf_without_a_directory_says_so(tmp_path):
    with pytest.raises(ValueError, match="model=hf needs the directory"):
        make_config(["model=hf"], run_dir=tmp_path)


def test_missing_safetensors_names_the_extra(monkeypatch, tmp_path):
    from hpctrain.checkpoint.hf_import import safe_open_or_explain

    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ValueError, match=r"pip install 'hpctrain\[hf\]'"):
        safe_open_or_explain()


def test_mixtral_training_settings_are_its_own_unless_the_run_sets_them(tmp_path):
    FAMILIES["mixtral"]().save_pretrained(tmp_path)
    m = make_config(["model=hf", f"model.init_from={tmp_path}"], run_dir=tmp_path).model
    assert (m.moe.aux_loss_coef, m.moe.z_loss_coef, m.moe.capacity_factor) == (0.001, 0.0, 0.0)
    m = make_config(["model=hf", f"model.init_from={tmp_path}", "model.moe.aux_loss_coef=0.02",
                     "model.moe.capacity_factor=1.25"], run_dir=tmp_path).model
    assert (m.moe.aux_loss_coef, m.moe.capacity_factor) == (0.02, 1.25)
    with pytest.raises(ValueError, match=r"model.moe.top_k=1 contradicts model.init_from="):
        make_config(["model=hf", f"model.init_from={tmp_path}", "model.moe.top_k=1"],
                    run_dir=tmp_path)


def test_shapes_without_an_exact_hugging_face_family_are_named():
    from hpctrain.models import PRESETS
    from hpctrain.models.llama.hf_config import export_family, hf_config

    assert export_family(PRESETS["mixtral_8x7b"]) == ("mixtral", [])
    family, why = export_family(PRESETS["debug_moe"])  # experts in every 2nd block, width 48
    assert family == "mixtral" and "model.moe.every=2 (Mixtral: 1)" in why
    assert any("expert_ffn_dim=48" in w for w in why)
    assert export_family(PRESETS["debug"].with_(qk_norm=True, head_dim=16))[0] == "qwen3"
    assert export_family(PRESETS["debug"].with_(attention_bias=True))[0] == "qwen2"
    _, why = export_family(PRESETS["debug"].with_(attention_bias=True, head_dim=16))
    assert "Qwen2 derives head_dim" in why[0]
    # q/k norms and q/k/v biases: Qwen3's attention_bias would bias o_proj too (issue 45)
    _, why = export_family(PRESETS["debug"].with_(qk_norm=True, attention_bias=True))
    assert "also biases o_proj" in why[0]
    with pytest.raises(ValueError, match="model.attention_bias=true with model.qk_norm=true"):
        hf_config(PRESETS["debug"].with_(qk_norm=True, attention_bias=True), dtype="fp32")
    with pytest.raises(ValueError, match="no exact Hugging Face form: model.moe.every=2"):
        hf_config(PRESETS["debug_moe"], dtype="fp32")


def test_the_data_tokenizer_defaults_to_the_model_directorys(tmp_path):
    """model.init_from with a tokenizer.json: the data is tokenised by it unless the run says
    otherwise, and another tokenizer (or data prepared with one) is refused, naming both."""
    from tests.unit.tokenizer_files import hf_tokenizer_dir

    pytest.importorskip("tokenizers")
    model = tmp_path / "model"
    save_tiny_llama(model, tied=True)
    hf_tokenizer_dir(model)
    (tmp_path / "c.txt").write_text("hello world , w1 w2 w3\n" * 400)
    data = ["data=files", f"data.paths=[{tmp_path / 'c.txt'}]",
            f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=16"]
    cfg = make_config(["model=hf", f"model.init_from={model}", *data], run_dir=tmp_path)
    assert (cfg.data.tokenizer, cfg.data.tokenizer_path) == ("hf", str(model))
    with pytest.raises(ValueError, match=r"data.tokenizer=bpe is not the tokenizer of model"):
        make_config(["model=hf", f"model.init_from={model}", *data, "data.tokenizer=bpe"],
                    run_dir=tmp_path)
    # byte given outright is a choice, not the default: refused too (issue 45: it trained)
    with pytest.raises(ValueError, match=r"data.tokenizer=byte is not the tokenizer of model"):
        make_config(["model=hf", f"model.init_from={model}", *data, "data.tokenizer=byte"],
                    run_dir=tmp_path)
    other = hf_tokenizer_dir(tmp_path / "other", words=41)
    with pytest.raises(ValueError, match=rf"data.tokenizer_path={other} is not the tokenizer"):
        make_config(["model=hf", f"model.init_from={model}", *data, "data.tokenizer=hf",
                     f"data.tokenizer_path={other}"], run_dir=tmp_path)
    same = hf_tokenizer_dir(tmp_path / "same")  # the same file elsewhere: the same ids
    make_config(["model=hf", f"model.init_from={model}", *data, "data.tokenizer=hf",
                 f"data.tokenizer_path={same}"], run_dir=tmp_path)
    # prepared with the byte tokenizer, then given as tokens: refused
    from hpctrain.data.prepare import prepare

    byte = make_config([*data, "data.tokenizer=byte"], run_dir=tmp_path)
    prepared = prepare(byte.data)
    with pytest.raises(ValueError, match=r"was prepared with data.tokenizer=byte"):
        make_config(["model=hf", f"model.init_from={model}", "data.source=tokens",
                     f"data.paths=[{prepared}]", "train.seq_len=16"], run_dir=tmp_path)


def _damaged(tmp_path, change) -> str:
    """The refusal of a tiny Llama directory after `change(directory, tensors)`, where
    `tensors` are its weights by name (rewritten into model.safetensors when returned)."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "model"
    save_tiny_llama(directory, tied=False)
    path = directory / "model.safetensors"
    tensors = change(directory, load_file(path))
    if tensors is not None:
        save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        make_config(["model=hf", f"model.init_from={directory}"], run_dir=tmp_path)
    return str(err.value)


def test_a_directory_that_is_not_its_config_is_refused_tensor_by_tensor(tmp_path):
    """Issue 45: a third layer's tensors in a two-layer directory trained (ignored), NaN
    weights were never named, and a missing or truncated file was a traceback in the ranks."""
    pytest.importorskip("safetensors")

    def third_layer(_, t):
        return {**t, "model.layers.2.input_layernorm.weight": torch.ones(64)}

    def nan(_, t):
        t["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
        return t

    def o_proj_bias(_, t):
        return {**t, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}

    def truncated(directory, _):
        path = directory / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def missing_shard(directory, t):
        index = {"weight_map": {name: "model-00002-of-00002.safetensors" for name in t}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))

    cases = [(third_layer, ["1 tensor(s) its config.json does not account for",
                            "model.layers.2.input_layernorm.weight"]),
             (o_proj_bias, ["model.layers.0.self_attn.o_proj.bias"]),
             (nan, ["non-finite weights", "model.layers.1.mlp.up_proj.weight (1 of"]),
             (truncated, ["model.safetensors", "download it again"]),
             (missing_shard, ["names model-00002-of-00002.safetensors, which is missing"])]
    for change, words in cases:
        message = _damaged(tmp_path / change.__name__, change)
        assert all(w in message for w in words), (change.__name__, message)
        assert "Traceback" not in message


def test_a_garbled_json_file_is_named(tmp_path):
    """Issue 45: JSON decoder errors named no file."""
    save_tiny_llama(tmp_path, tied=False)
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=rf"{tmp_path}/config.json is not valid JSON \(.*line 1"):
        make_config(["model=hf", f"model.init_from={tmp_path}"], run_dir=tmp_path)

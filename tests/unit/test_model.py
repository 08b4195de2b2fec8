"""The model: counts match the built model; attention backends agree; checkpointing is exact."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.models import PRESETS, build_model
from hpctrain.models.checkpointing import apply_activation_checkpointing
from hpctrain.ops.attention import eager_attention, get_attention, sdpa_attention
from hpctrain.ops.linear import Linear, WeightGradQueue


@pytest.mark.parametrize("name", ["debug", "tiny"])
@pytest.mark.parametrize("tied", [False, True])
def test_param_count_matches_built_model(name, tied):
    cfg = PRESETS[name].with_(tied_embeddings=tied)
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize("options", [dict(attention_bias=True), dict(qk_norm=True),
                                     dict(head_dim=12, n_heads=3, n_kv_heads=1)])
def test_attention_options_counts_match_built_model(options):
    """q/k/v biases (Qwen2), q/k norms (Qwen3) and a head width that is not dim / n_heads:
    the counts, and the FLOPs of the matmuls, follow the built model."""
    cfg = PRESETS["debug"].with_(attention="eager", **options)
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    x = torch.randint(0, cfg.vocab_size, (1, 16))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert counter.get_total_flops() == cfg.flops_per_token(16) * 16


def test_a_derived_head_dim_follows_dim():
    cfg = PRESETS["debug"]
    assert cfg.head_dim == 8 and cfg.with_(dim=64).head_dim == 16
    assert cfg.with_(head_dim=12).with_(dim=64).head_dim == 12  # explicit: kept


def test_big_preset_counts_are_llama3_sizes():
    assert abs(PRESETS["llama3_8b"].num_params() / 1e9 - 8.03) < 0.01
    assert abs(PRESETS["llama3_70b"].num_params() / 1e9 - 70.55) < 0.01
    assert abs(PRESETS["llama3_405b"].num_params() / 1e9 - 405.8) < 0.1


def test_moe_preset_counts_are_the_published_sizes():
    """Mixtral-8x7B: 46.7B total, 12.9B active. DeepSeekMoE-16B: 16.4B total, 2.8B active,
    with its dense block 0 (ffn 10944) in place of the MoE block the preset puts there."""
    mixtral = PRESETS["mixtral_8x7b"]
    assert round(mixtral.num_params() / 1e9, 1) == 46.7
    assert round(mixtral.num_params(active=True) / 1e9, 1) == 12.9
    ds = PRESETS["deepseek_moe_16b"]
    dense0 = ds.with_(moe=ds.moe.__class__()).layer_params(0)  # block 0 as published: dense
    assert ds.ffn_dim == 10944 and ds.is_moe_layer(0)
    assert round((ds.num_params() - ds.layer_params(0) + dense0) / 1e9, 1) == 16.4
    assert round((ds.num_params(active=True) - ds.layer_params(0, active=True) + dense0)
                 / 1e9, 1) == 2.8


def test_flops_per_token_matches_counted_flops():
    cfg = PRESETS["debug"].with_(attention="eager")
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    assert counter.get_total_flops() == cfg.flops_per_token(48) * tokens.numel()


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (4, 2), (4, 1)])
def test_sdpa_matches_eager_forward_and_backward(n_heads, n_kv):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, n_heads, 33, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, n_kv, 33, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, n_kv, 33, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    grads = []
    for fn in (eager_attention, sdpa_attention):
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
        q.grad = k.grad = v.grad = None
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_eager_attention_is_causal():
    q = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    k, v = q.clone(), torch.randn(1, 1, 5, 4, dtype=torch.float64)
    v2 = v.clone()
    v2[..., 3:, :] += 100.0  # the future must not change the past
    torch.testing.assert_close(eager_attention(q, k, v)[..., :3, :],
                               eager_attention(q, k, v2)[..., :3, :])


def test_unknown_attention_names_the_choices():
    with pytest.raises(ValueError, match="eager, sdpa"):
        get_attention("flash9")


def _grads(model, tokens):
    model.zero_grad()
    out = model(tokens)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_is_exact(mode):
    cfg = PRESETS["debug"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    ref_out, ref = _grads(build_model(cfg, seed=3), tokens)
    model = build_model(cfg, seed=3)
    apply_activation_checkpointing(model, mode)
    out, got = _grads(model, tokens)
    assert torch.equal(out, ref_out)
    assert got.keys() == ref.keys()  # the full model's names, no wrapper prefix
    for name, g in ref.items():
        assert torch.equal(got[name], g), name


def test_linear_deferred_weight_grad_equals_immediate():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    lin = Linear(8, 6, bias=True).double()
    lin.weight.data = torch.randn(6, 8, dtype=torch.float64, generator=gen)
    lin(x).pow(2).sum().backward()
    ref_w, ref_b, ref_x = lin.weight.grad.clone(), lin.bias.grad.clone(), x.grad.clone()
    lin.weight.grad = lin.bias.grad = x.grad = None
    lin.wgrad_queue = queue = WeightGradQueue()
    queue.deferring = True
    lin(x).pow(2).sum().backward()
    assert lin.weight.grad is None and len(queue) == 1
    torch.testing.assert_close(x.grad, ref_x, rtol=0, atol=0)
    queue.run_all()
    torch.testing.assert_close(lin.weight.grad, ref_w, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(lin.bias.grad, ref_b, rtol=1e-14, atol=1e-14)


def test_linear_under_bf16_autocast_keeps_fp32_params():
    lin = Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_pipeline_stages_are_parts_of_the_model_itself(n_stages, tied):
    """A stage is the model's own modules for its layers (models.family.Part), built and run
    by the model's own code: the parts' parameters are the whole model's, name for name and
    value for value (a tied head starts as the embedding), and chaining their forwards gives
    the whole model's logits bit for bit."""
    import dataclasses

    from hpctrain.models import Part

    cfg = dataclasses.replace(PRESETS["debug_moe"], tied_embeddings=tied)
    whole = build_model(cfg, seed=3)
    parts = [build_model(cfg, seed=3, part=Part.stage(s, n_stages=n_stages,
                                                       n_layers=cfg.n_layers))
             for s in range(n_stages)]
    want = dict(whole.named_parameters())
    got = {}
    for part in parts:
        for name, p in part.named_parameters():
            name = "tok_embeddings.weight" if tied and name == "output.weight" else name
            assert name not in got or torch.equal(got[name], p), name
            got[name] = p
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    h = tokens
    for part in parts:
        h = part(h)
    assert torch.equal(h, whole(tokens))
    with pytest.raises(ValueError, match="not divisible by 3 pipeline stages"):
        Part.stage(0, n_stages=3, n_layers=cfg.n_layers)

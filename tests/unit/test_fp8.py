"""FP8 linears: the three float8 GEMMs equal an independent emulation (quantize with scales
from amax, dequantize, multiply in fp32) to fp32 rounding, forward and both backward products,
for tensorwise and rowwise scaling; the deferred weight gradient equals the immediate one; the
config refuses fp8 without bf16; apply_fp8 keeps the embedding and output head out."""

from __future__ import annotations

import pytest
import torch

from hpctrain.models import PRESETS, build_model
from hpctrain.ops.fp8 import Fp8Spec
from hpctrain.ops.linear import WeightGradQueue, linear
from hpctrain.parallel.fp8 import apply_fp8
from tests.conftest import make_config

T, I, O = 24, 40, 16  # noqa: E741 (the legend's I: input features)


def _emulate(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
    """Quantize-dequantize, written independently of hpctrain.ops.fp8."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = fmax / amax.float()
    return (t * scale).clamp(-fmax, fmax).to(dtype).float() * scale.reciprocal()


def _data():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, T // 2, I, generator=gen) * torch.linspace(0.1, 8, I)  # uneven columns
    w = torch.randn(O, I, generator=gen) * 0.2
    dy = torch.randn(2, T // 2, O, generator=gen) * torch.linspace(1e-3, 1, O)
    return x, w, torch.randn(O, generator=gen), dy


def _assert_fp32_rounding_apart(got, a, b, bias=None):
    """got equals a @ b (+ bias) up to fp32 rounding; a, b the dequantized fp32 operands.

    Both sides hold the same exact float8 values and scales; they differ only in where fp32
    rounds: the emulation rounds each dequantized element (≤ u relative, u = 2⁻²⁴) and then
    sums K products in some order; `torch._scaled_mm` may sum q_a·q_b first and scale after
    (a fused oneDNN kernel on AMX/avx512_bf16 x86 CPUs, one ulp off), or sum in another order
    or blocking. A K-term fp32 dot product is within γ_K = K·u/(1 - K·u) of the exact one,
    relative to Σ|a_k|·|b_k| (Higham, Accuracy and Stability, 3.1), so two of them differ by
    at most ~2(K + 1)·u·(|a| @ |b|), plus one rounding of the bias add. Any wrong scale,
    amax or float8 rounding moves the result by far more (≥ 2⁻⁴ of one term)."""
    u, k = torch.finfo(torch.float32).eps / 2, a.shape[-1]
    want = a @ b if bias is None else a @ b + bias
    magnitude = a.abs() @ b.abs() + (0 if bias is None else bias.abs())
    excess = (got - want).abs() - 2 * (k + 1) * u * magnitude
    assert excess.max() <= 0, f"{excess.max():.3g} beyond fp32 rounding of {k}-term sums"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gemms_equal_emulation_to_fp32_rounding(recipe):
    x, w, b, dy = _data()
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    y = linear(xr, wr, br, fp8=Fp8Spec(recipe))
    y.backward(dy)
    row = recipe == "rowwise"
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    x2, dy2 = x.reshape(T, I), dy.reshape(T, O)
    _assert_fp32_rounding_apart(y.reshape(T, O), _emulate(x2, e4, -1 if row else None),
                                _emulate(w, e4, -1 if row else None).t(), b)
    _assert_fp32_rounding_apart(xr.grad.reshape(T, I), _emulate(dy2, e5, -1 if row else None),
                                _emulate(w, e4, 0 if row else None))
    _assert_fp32_rounding_apart(wr.grad, _emulate(dy2, e5, 0 if row else None).t(),
                                _emulate(x2, e4, 0 if row else None))
    assert torch.equal(br.grad, dy2.sum(0))
    # and float8 really ran: not the fp32 product
    assert (y.reshape(T, O) - (x2 @ w.t() + b)).abs().max() > 1e-3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torch_scaled_mm_equals_the_cpu_emulation_to_fp32_rounding(recipe):
    """hpctrain runs FP8 GEMMs on CPU through the emulation; torch's own `_scaled_mm` (the
    accelerator path) computes the same product to fp32 rounding (small: on AMX CPUs it is
    ~800x slower)."""
    from hpctrain.ops.fp8 import emulated_mm, quantize, torch_scaled_mm

    x, w, _, _ = _data()
    axis = -1 if recipe == "rowwise" else None
    a = quantize(x.reshape(T, I), torch.float8_e4m3fn, dim=axis, group=None)
    b = quantize(w, torch.float8_e4m3fn, dim=axis, group=None)
    bt = b.t()
    got = torch_scaled_mm(a, bt, out_dtype=torch.float32)
    _assert_fp32_rounding_apart(got, a.q.float() * a.inv, (b.q.float() * b.inv).t())
    assert torch.equal(emulated_mm(a, bt, out_dtype=torch.float32),
                       (a.q.float() * a.inv) @ (b.q.float() * b.inv).t())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_deferred_weight_grad_equals_immediate(recipe):
    x, w, _, dy = _data()
    w_now, w_later = w.clone().requires_grad_(), w.clone().requires_grad_()
    linear(x, w_now, fp8=Fp8Spec(recipe)).backward(dy)
    queue = WeightGradQueue()
    queue.deferring, queue.tag = True, 0
    xr = x.clone().requires_grad_()
    linear(xr, w_later, queue=queue, fp8=Fp8Spec(recipe)).backward(dy)
    assert w_later.grad is None and queue.pending(0) == 1
    queue.run(0)
    assert torch.equal(w_later.grad, w_now.grad)


def test_bf16_autocast_outputs_bf16_grads_in_param_dtype():
    x, w, _, dy = _data()
    wr = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, wr, fp8=Fp8Spec())
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert wr.grad.dtype == torch.float32


def test_fp8_needs_bf16():
    with pytest.raises(ValueError, match=r"train.fp8=true.*train.precision=fp32.*precision=bf16"):
        make_config(["train.fp8=true", "train.precision=fp32"])
    assert make_config(["train.fp8=true", "train.precision=bf16"]).train.fp8


def test_apply_fp8_skips_embedding_and_head():
    model = build_model(PRESETS["debug"], seed=0)
    done = apply_fp8(model, recipe="rowwise", skip=("tok_embeddings", "output"))
    assert model.output.fp8 is None and "output" not in done
    assert model.layers["0"].attn.wq.fp8 == Fp8Spec("rowwise")
    assert len(done) == 7 * len(model.layers)  # wq wk wv wo w1 w2 w3


def test_planner_times_block_linears_at_fp8_peak():
    """H200: the block projections' GEMMs on the FP8 roofline (1979 ≈ 2 × 989 TFLOP/s dense,
    1-byte operands), the rest (attention core, elementwise, head) unchanged in bf16; MFU keeps
    the bf16 denominator."""
    from hpctrain.metrics.devices import DEVICES
    from hpctrain.plan.cluster import ClusterSpec
    from hpctrain.plan.kernels import _projections, layer_cost, roofline
    from hpctrain.plan.layout import Layout
    from hpctrain.plan.time import step_time

    h200 = DEVICES["H200"]
    assert h200.peak_flops("fp8") == 1979e12  # the datasheet's 3,958 TFLOPS with sparsity, halved
    model = PRESETS["debug"].with_(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                                   ffn_dim=8192, vocab_size=32000, max_seq_len=2048)
    cluster = ClusterSpec(device=h200, gpus_per_node=8, intra_node_bw=450e9, inter_node_bw=50e9)
    kw = dict(layout=Layout(), global_batch=8, micro_batch_size=8, seq_len=2048)
    bf16, fp8 = step_time(model, cluster, **kw), step_time(model, cluster, **kw, fp8=True)
    frac = cluster.achievable_fraction
    r, r8 = (roofline(h200, precision=p, achievable_fraction=frac) for p in ("bf16", "fp8"))
    shape = dict(mbs=8, seq_len=2048, keys=2048, tp=1, sp=False, recompute="none",
                 precision="bf16")
    lc, lc8 = layer_cost(model, r, **shape), layer_cost(model, r, **shape, fp8=r8)
    assert lc8.w == pytest.approx(_projections(model, r8, tokens=8 * 2048, tp=1, elem=1))
    assert lc8.w < 0.6 * lc.w  # the projections at about twice the rate
    assert lc8.f - lc8.w == pytest.approx(lc.f - lc.w, rel=1e-12)  # core + elementwise unchanged
    # one micro-batch, one chunk: F, B and W each hold the projections once per layer
    saved = model.n_layers * 3 * (lc.w - lc8.w)
    assert bf16.compute_s - fp8.compute_s == pytest.approx(saved, rel=1e-9)
    assert fp8.mfu / bf16.mfu == pytest.approx(bf16.step_time_s / fp8.step_time_s, rel=1e-9)
    from hpctrain.plan.memory.formulas import memory_breakdown

    mem = dict(seq_len=2048, micro_batch_size=8, in_flight=1)
    extra = (memory_breakdown(model, Layout(), **mem, fp8=True).buffers
             - memory_breakdown(model, Layout(), **mem).buffers)
    assert extra == model.n_layers * (model.layer_params() - 2 * model.dim)  # 1 B per weight

"""hpctrain's Linear in float8: the autograd function behind `linear(..., fp8=spec)`.

Legend: T tokens (leading dims flattened), I input features, O output features.
Forward y_TO = x_TI W_OIᵀ (+ b) as a float8 GEMM (E4M3 × E4M3); backward dx = dy W
(E5M2 × E4M3) and dW = dyᵀ x (E5M2 × E4M3), scales and tp reductions as in
`hpctrain.ops.fp8`. Outputs are in the compute dtype (the autocast dtype when enabled, as in
`LinearFunction`), dx in x's dtype, dW and db accumulate in the parameters' dtype (fp32 master
weights stay fp32; the optimizer never sees float8). The bias is added in the compute dtype.

Only float8 tensors (and their scales) are saved for backward — the quantized x and W the
backward products need: for tensorwise the forward's own, for rowwise the copies scaled along
the backward contraction axes (T for x, O for W). With a `WeightGradQueue` that is deferring
(a zero-bubble B action), dy is quantized at once (its amax collective, if any, happens now)
and the grad-weight GEMM is queued over those same float8 tensors for the W action.
"""

from __future__ import annotations

import torch

from hpctrain.ops.fp8 import E4M3, E5M2, Fp8Spec, Quantized, quantize, scaled_mm
from hpctrain.ops.grads import accumulate_grad, autocast_off, compute_dtype


def _groups(spec: Fp8Spec) -> dict[str, object]:
    """The group each quantization reduces its amax over (None: local), by operand and GEMM."""
    split_in, split_out = spec.sharded == "in", spec.sharded == "out"

    def g(operand_split: bool, contraction_split: bool):
        hit = spec.reduces(operand_split=operand_split, contraction_split=contraction_split)
        return spec.group if hit else None

    sharded = spec.sharded != "none"
    return {"x_fwd": g(split_in, split_in), "w_fwd": g(sharded, split_in),
            "x_wgrad": g(split_in, False), "w_dgrad": g(sharded, split_out),
            "dy_dgrad": g(split_out, split_out), "dy_wgrad": g(split_out, False)}


def _forward(x, weight, bias, spec: Fp8Spec, dtype: torch.dtype):
    """y_TO in `dtype`, and the quantized x_TI and W_OI that backward needs."""
    groups, rowwise = _groups(spec), spec.recipe == "rowwise"
    x_TI = x.reshape(-1, x.shape[-1])
    x_f = quantize(x_TI, E4M3, dim=-1 if rowwise else None, group=groups["x_fwd"])
    w_f = quantize(weight, E4M3, dim=-1 if rowwise else None, group=groups["w_fwd"])
    y_TO = scaled_mm(x_f, w_f.t(), out_dtype=dtype)
    if bias is not None:
        y_TO = y_TO + bias.to(dtype)
    if rowwise:  # backward contracts over T (x) and O (W): scales along those axes
        x_f = quantize(x_TI, E4M3, dim=0, group=groups["x_wgrad"])
        w_f = quantize(weight, E4M3, dim=0, group=groups["w_dgrad"])
    return y_TO, x_f, w_f


class Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, queue, spec: Fp8Spec):
        dtype = compute_dtype(x)
        with autocast_off(x.device.type):
            y_TO, x_f, w_f = _forward(x, weight, bias, spec, dtype)
        ctx.save_for_backward(x_f.q, x_f.inv, w_f.q, w_f.inv)
        ctx.weight, ctx.bias, ctx.queue, ctx.spec = weight, bias, queue, spec
        ctx.x_dtype, ctx.x_shape, ctx.dtype = x.dtype, x.shape, dtype
        return y_TO.reshape(*x.shape[:-1], y_TO.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x_q, x_inv, w_q, w_inv = ctx.saved_tensors
        x_b, w_b = Quantized(x_q, x_inv), Quantized(w_q, w_inv)
        groups, rowwise = _groups(ctx.spec), ctx.spec.recipe == "rowwise"
        dy_TO = grad_out.reshape(-1, grad_out.shape[-1])
        dy_f = quantize(dy_TO, E5M2, dim=-1 if rowwise else None, group=groups["dy_dgrad"])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(dy_f, w_b, out_dtype=ctx.dtype).to(ctx.x_dtype)
            grad_x = grad_x.reshape(ctx.x_shape)
        dy_w = quantize(dy_TO, E5M2, dim=0, group=groups["dy_wgrad"]) if rowwise else dy_f
        weight, bias = ctx.weight, ctx.bias
        db = dy_TO.sum(0) if bias is not None else None

        def weight_grad() -> torch.Tensor:
            return scaled_mm(dy_w.t(), x_b, out_dtype=torch.float32)

        queue = ctx.queue
        if queue is not None and queue.deferring:
            def deferred():
                with torch.no_grad():  # runs outside autograd's backward: build no graph
                    accumulate_grad(weight, weight_grad())
                if db is not None:
                    accumulate_grad(bias, db)

            queue.put(deferred)
            return grad_x, None, None, None, None
        gw = weight_grad().to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = db.to(bias.dtype) if db is not None and ctx.needs_input_grad[2] else None
        return grad_x, gw, gb, None, None

"""hpctrain's Linear: y = x Wᵀ (+ b), whose weight gradient a pipeline stage can defer.

Zero-bubble pipeline schedules split the backward: the input gradient ∂L/∂x = ∂L/∂y · W is
computed at once (the B action), while the weight gradient ∂L/∂W = ∂L/∂yᵀ · x is pushed as a
closure onto a `WeightGradQueue` and computed later (the W action) from tensors kept since
forward — nothing is recomputed. Two ways, the same products:

  hook path      (`_deferrable_linear`) torch's own linear node over a detached weight, so
                 autograd computes only ∂L/∂x in C++, and a hook on y that receives ∂L/∂y and
                 queues (B) or runs at once (a full backward) the weight GEMM, accumulating
                 into `.grad` in place (addmm_). Taken when nothing needs casting and no
                 saved-tensor hooks are active.
  LinearFunction a Python autograd function: used when the hook path cannot be (x needs no
                 grad, a cast under autocast, inside torch.compile (traced as a graph, where
                 the hook would break it), or saved-tensor hooks — activation checkpointing
                 recomputes x through save_for_backward, which a hook's own reference to x
                 would defeat: x would stay alive from forward to W).

Measured (bench_pp's real model, ZB-V, pp=2, A/B in the same two processes, 2026-12-01): the
hook path cut each rank's compute per step by 8–11 ms (W actions 78 vs 86 ms on rank 0);
per-call microbenchmarks at 128 × 256 @ 704 × 256 were within their ±3 % noise. Pipeline
stages whose schedule never defers, and all other layers, use `F.linear`.

Autocast (LinearFunction): the compute dtype is fixed in forward (the autocast dtype when
enabled) and reused in backward, so bf16 compute with fp32 parameters works; weight gradients
are returned in the parameter's dtype.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.ops.fp8 import Fp8Spec
from hpctrain.ops.fp8_linear import Fp8LinearFunction
from hpctrain.ops.grads import accumulate_grad, autocast_enabled, autocast_off, compute_dtype

# torch's own test for active saved-tensor hooks (checkpointing, offloading); absent → assume
# active, which only costs speed (LinearFunction)
_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks",
                              lambda _tracing: True)


class WeightGradQueue:
    """Deferred weight-gradient computations, filed under a tag (a pipeline stage uses the
    microbatch). `deferring` and `tag` are set by the stage around a B action; `run(tag)` (a W
    action) computes and accumulates that tag's entries in FIFO order, `run_all` every tag's."""

    def __init__(self):
        self.deferring = False
        self.tag: Hashable = None
        # False when no action will ever defer (a schedule without B/W split, set by the
        # pipeline runtime): the layers then take torch's own linear (`linear` says why).
        self.may_defer = True
        self._pending: dict[Hashable, deque[Callable[[], None]]] = {}

    def put(self, fn: Callable[[], None]) -> None:
        self._pending.setdefault(self.tag, deque()).append(fn)

    def __len__(self) -> int:
        return sum(len(q) for q in self._pending.values())

    def pending(self, tag: Hashable) -> int:
        return len(self._pending.get(tag, ()))

    def run(self, tag: Hashable) -> int:
        fns = self._pending.pop(tag, deque())
        n = len(fns)
        while fns:
            fns.popleft()()
        return n

    def run_all(self) -> int:
        return sum(self.run(tag) for tag in list(self._pending))


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, queue):
        dtype = compute_dtype(x)
        if x.dtype == weight.dtype == dtype and (bias is None or bias.dtype == dtype):
            # nothing to cast: skip the autocast scope and the casts (~10 µs of the ~45 µs
            # this function costs over F.linear per forward + backward, measured)
            x_c, w_c, out = x, weight, F.linear(x, weight, bias)
        else:
            with autocast_off(x.device.type):
                x_c, w_c = x.to(dtype), weight.to(dtype)
                out = F.linear(x_c, w_c, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x_c, w_c)
        ctx.weight, ctx.bias, ctx.queue, ctx.x_dtype = weight, bias, queue, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_c, w_c = ctx.saved_tensors
        grad_out = grad_out.to(w_c.dtype)
        grad_x = (grad_out @ w_c).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        weight, bias = ctx.weight, ctx.bias

        def weight_grad():
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            return g2.t() @ x_c.reshape(-1, x_c.shape[-1]), g2.sum(0) if bias is not None else None

        queue = ctx.queue
        if queue is not None and queue.deferring:
            def deferred():
                with torch.no_grad():  # runs outside autograd's backward: build no graph
                    gw, gb = weight_grad()
                accumulate_grad(weight, gw)
                if gb is not None:
                    accumulate_grad(bias, gb)

            queue.put(deferred)
            return grad_x, None, None, None
        gw, gb = weight_grad()
        gw = gw.to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = gb.to(bias.dtype) if gb is not None and ctx.needs_input_grad[2] else None
        return grad_x, gw, gb, None


class _WeightGradHook:
    """The hook path's pre-hook on y's autograd node: given ∂L/∂y, queue the weight GEMM
    when the queue is deferring (a B action), else run it now (a full backward)."""

    __slots__ = ("x", "weight", "bias", "queue")

    def __init__(self, x, weight, bias, queue):
        self.x, self.weight, self.bias, self.queue = x, weight, bias, queue

    def __call__(self, grad_outputs: tuple[torch.Tensor]) -> None:
        grad_y = grad_outputs[0]  # y is its node's only output
        if self.queue.deferring:
            self.queue.put(lambda: self.run(grad_y))
        else:
            self.run(grad_y)

    def run(self, grad_y: torch.Tensor) -> None:
        """.grad += ∂L/∂yᵀ · x (one fused GEMM when .grad exists), outside autograd."""
        w, b = self.weight, self.bias
        with torch.no_grad():
            g2 = grad_y.reshape(-1, grad_y.shape[-1])
            x2 = self.x.reshape(-1, self.x.shape[-1])
            if w.grad is None:
                w.grad = g2.t() @ x2
            else:
                w.grad.addmm_(g2.t(), x2)
            if b is not None:
                accumulate_grad(b, g2.sum(0))


def _hook_path_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if torch.compiler.is_compiling():  # compiled blocks (train.compile) keep the traced function
        return False
    return (x.requires_grad and torch.is_grad_enabled() and weight.requires_grad
            and (bias is None or (bias.requires_grad and bias.dtype == weight.dtype))
            and x.dtype == weight.dtype
            and compute_dtype(x) == x.dtype and _saved_tensor_hooks(False) is None)


def _deferrable_linear(x, weight, bias, queue: WeightGradQueue) -> torch.Tensor:
    """The hook path (module docstring): autograd never computes the weight's gradient, the
    hook does — in B's W closure or at once."""
    y = F.linear(x, weight.detach(), None if bias is None else bias.detach())
    # a pre-hook on y's node: one C++ call (Tensor.register_hook's Python costs ~5 µs more)
    y.grad_fn.register_prehook(_WeightGradHook(x, weight, bias, queue))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           queue: WeightGradQueue | None = None, fp8: Fp8Spec | None = None) -> torch.Tensor:
    """y = x Wᵀ (+ b). In float8 through `Fp8LinearFunction` when `fp8` is given
    (`hpctrain.ops.fp8_linear`); else by the hook path or `LinearFunction` when `queue` may
    defer the weight gradient (a zero-bubble pipeline stage; module docstring), or
    `LinearFunction` to cast an input whose dtype differs
    from the weight's outside autocast; otherwise `F.linear`, whose C++ autograd node costs
    ~0.1 ms less per forward + backward than the Python function (measured on one thread,
    128 × 256 @ 256 × 704: 1.50 vs 1.60 ms) — the same products, so the same gradients."""
    if fp8 is not None:
        return Fp8LinearFunction.apply(x, weight, bias, queue, fp8)
    if queue is not None and queue.may_defer:
        if _hook_path_ok(x, weight, bias):
            return _deferrable_linear(x, weight, bias, queue)
        return LinearFunction.apply(x, weight, bias, queue)
    if x.dtype != weight.dtype and not autocast_enabled(x.device.type):
        return LinearFunction.apply(x, weight, bias, None)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """Drop-in for nn.Linear (same parameter names and layout: weight is out × in)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.wgrad_queue: WeightGradQueue | None = None
        self.fp8: Fp8Spec | None = None  # set by hpctrain.parallel.fp8.apply_fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, queue=self.wgrad_queue, fp8=self.fp8)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

"""Tensor-parallel communication as conjugate autograd functions, with a byte counter.

Legend: B batch, L sequence (full), l = L/tp (local sequence shard), D model dim.
Megatron's pair: `copy_to_tp` (f) is the identity forward and an all-reduce (sum) backward;
`reduce_from_tp` (g) is the all-reduce forward and the identity backward. For sequence
parallelism `gather_seq` all-gathers x_BlD → x_BLD forward and reduce-scatters backward;
`reduce_scatter_seq` is its conjugate. `gather_last` / `split_last` do the same along the last
dim without reduction (split's conjugate is a gather, gather's is a split).
Every op takes its group explicitly and is the identity when the group has one rank.
Under torch.compile (train.compile) every op runs outside the graph: `_eager` makes each call
one clean graph break, found once at trace time, instead of dynamo trying (and failing) to
trace the autograd functions' side effects (the byte counter). torch.compiler.disable imports
torch._dynamo (about a second per process), so the ops are disabled when a model is first
compiled (`models.compile.before_compile`), not when this module is imported.

Bytes sent per rank follow the ring algorithms (what NCCL's bus bandwidth assumes): an
all-reduce of n bytes sends 2(p−1)/p·n, an all-gather producing n bytes sends (p−1)/p·n and a
reduce-scatter of n input bytes sends (p−1)/p·n. `CommCounter` accumulates them by kind.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_rank, group_size
from hpctrain.models.compile import before_compile

SEQ_DIM = 1


class CommCounter:
    """Bytes this rank sent on the tp axis, by kind ("all_reduce", "all_gather", ...)."""

    def __init__(self):
        self.by_kind: dict[str, int] = defaultdict(int)

    def add(self, kind: str, nbytes: int) -> None:
        self.by_kind[kind] += nbytes

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def reset(self) -> None:
        self.by_kind.clear()


_size, _rank = group_size, group_rank  # short names for the many call sites below
_BODIES: dict[str, Callable] = {}  # op name → its body, or its disabled body once compiling


def _eager(fn: Callable) -> Callable:
    """`fn`, called through `_BODIES` so that `_keep_out_of_graphs` can swap in its
    torch.compiler.disable'd form before anything is compiled (module docstring)."""
    name = fn.__name__
    _BODIES[name] = fn

    @functools.wraps(fn)
    def op(*args, **kwargs):
        return _BODIES[name](*args, **kwargs)

    return op


def _keep_out_of_graphs() -> None:
    for name, fn in _BODIES.items():
        if not getattr(fn, "_torchdynamo_disable", False):
            _BODIES[name] = torch.compiler.disable(fn)


before_compile(_keep_out_of_graphs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(x: torch.Tensor, *, group, counter: CommCounter | None,
               op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Out-of-place all-reduce over `group`, counted as 2(p−1)/p·bytes(x)."""
    p = _size(group)
    out = x.contiguous().clone()
    dist.all_reduce(out, op=op, group=group)
    if counter is not None:
        counter.add("all_reduce", 2 * (p - 1) * _nbytes(x) // p)
    return out


def _all_gather(x: torch.Tensor, dim: int, group, counter) -> torch.Tensor:
    p = _size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((p * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, moved, group=group)
    if counter is not None:
        counter.add("all_gather", (p - 1) * _nbytes(out) // p)
    # contiguous once here: every linear reading a strided view copies it for its matmul
    # and saves its own copy (sp's q/k/v and w1/w3: 5 copies of the gathered input a block)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group, counter) -> torch.Tensor:
    p = _size(group)
    if x.shape[dim] % p:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {p} "
                         f"ranks: make the sequence length a multiple of tp={p}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // p, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, moved, group=group)
    if counter is not None:
        counter.add("reduce_scatter", (p - 1) * _nbytes(x) // p)
    return out.movedim(0, dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    p = _size(group)
    if x.shape[dim] % p:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over tp={p}")
    return x.chunk(p, dim=dim)[_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, group=ctx.group, counter=ctx.counter), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        return all_reduce(x, group=group, counter=counter)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherDim(torch.autograd.Function):
    """Forward all-gather along `dim`; backward reduce-scatter (reduce=True) or split."""

    @staticmethod
    def forward(ctx, x, dim, reduce, group, counter):
        ctx.dim, ctx.reduce, ctx.group, ctx.counter = dim, reduce, group, counter
        return _all_gather(x, dim, group, counter)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            out = _reduce_scatter(grad, ctx.dim, ctx.group, ctx.counter)
        else:
            out = _split(grad, ctx.dim, ctx.group)
        return out, None, None, None, None


class _ScatterDim(torch.autograd.Function):
    """Forward reduce-scatter (reduce=True) or split along `dim`; backward all-gather."""

    @staticmethod
    def forward(ctx, x, dim, reduce, group, counter):
        ctx.dim, ctx.group, ctx.counter = dim, group, counter
        return _reduce_scatter(x, dim, group, counter) if reduce else _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group, ctx.counter), None, None, None, None


@_eager
def copy_to_tp(x: torch.Tensor, *, group, counter: CommCounter | None = None) -> torch.Tensor:
    """f: y = x; ∂L/∂x = Σ_tp ∂L/∂y (each rank's branch contributes a partial gradient)."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group, counter)


@_eager
def reduce_from_tp(x: torch.Tensor, *, group, counter: CommCounter | None = None) -> torch.Tensor:
    """g: y = Σ_tp x; ∂L/∂x = ∂L/∂y."""
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group, counter)


@_eager
def gather_seq(x_BlD: torch.Tensor, *, group, counter: CommCounter | None = None):
    """x_BlD → x_BLD (all-gather along the sequence); backward reduce-scatters ∂L/∂x_BLD."""
    if _size(group) == 1:
        return x_BlD
    return _GatherDim.apply(x_BlD, SEQ_DIM, True, group, counter)


@_eager
def reduce_scatter_seq(x_BLD: torch.Tensor, *, group, counter: CommCounter | None = None):
    """x_BLD (partial sums) → Σ_tp x, this rank's sequence shard x_BlD; backward all-gathers."""
    if _size(group) == 1:
        return x_BLD
    return _ScatterDim.apply(x_BLD, SEQ_DIM, True, group, counter)


@_eager
def scatter_seq(x_BLD: torch.Tensor, *, group, counter: CommCounter | None = None):
    """x_BLD (replicated) → this rank's shard x_BlD (no communication); backward all-gathers."""
    if _size(group) == 1:
        return x_BLD
    return _ScatterDim.apply(x_BLD, SEQ_DIM, False, group, counter)


@_eager
def gather_last(x: torch.Tensor, *, group, counter: CommCounter | None = None) -> torch.Tensor:
    """[..., n/tp] → [..., n] (all-gather along the last dim); backward takes this rank's slice."""
    if _size(group) == 1:
        return x
    return _GatherDim.apply(x, x.dim() - 1, False, group, counter)


@_eager
def split_last(x: torch.Tensor, *, group, counter: CommCounter | None = None) -> torch.Tensor:
    """[..., n] → this rank's [..., n/tp] slice; backward all-gathers the gradient."""
    if _size(group) == 1:
        return x
    return _ScatterDim.apply(x, x.dim() - 1, False, group, counter)

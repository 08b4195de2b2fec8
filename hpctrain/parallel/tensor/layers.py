"""Megatron column/row-parallel linears, a vocab-parallel embedding and a tp-entry RMSNorm.

Legend: B batch, L sequence, l = L/tp, D model dim (in), O output features, p = tp degree,
V vocabulary, v = V/p. Weights are `out × in` as in hpctrain.ops.linear.Linear, and every local
matmul goes through `hpctrain.ops.linear.linear` so a zero-bubble pipeline can defer its weight
gradient through `wgrad_queue`.

Column-parallel: Y = X A with A split by columns (our weight rows): rank r holds A_r and
computes Y_r = X A_r, its slice of the output features. Row-parallel: A split by rows (our
weight columns), X split along its last dim; Y = Σ_r X_r A_r, then + b once.

How a layer's input enters the parallel region (`entry`):
  "copy"       f: identity forward, all-reduce backward (input replicated across tp)
  "gather_seq" all-gather the sequence-sharded input, reduce-scatter backward (sp)
  "none"       the caller already did one of the above (so several layers share one collective)
and how a row-parallel output leaves it (`exit`): "reduce" (g, all-reduce) or "reduce_scatter_seq".
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.ops.fp8 import Fp8Spec
from hpctrain.ops.linear import WeightGradQueue, linear
from hpctrain.ops.norms import RMSNorm
from hpctrain.parallel.tensor.comm import (
    CommCounter,
    _rank,
    _size,
    copy_to_tp,
    gather_last,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
)

Entry = Literal["copy", "gather_seq", "none"]
Exit = Literal["reduce", "reduce_scatter_seq"]


def _enter(x, entry: Entry, group, counter):
    if entry == "copy":
        return copy_to_tp(x, group=group, counter=counter)
    if entry == "gather_seq":
        return gather_seq(x, group=group, counter=counter)
    return x


def shard_rows(full: torch.Tensor, *, index: int, n_shards: int) -> torch.Tensor:
    """Rows [index·n/k, (index+1)·n/k) of `full` (a copy, detached)."""
    if full.shape[0] % n_shards:
        raise ValueError(f"cannot split {full.shape[0]} rows into {n_shards} shards: "
                         f"choose a tp degree that divides {full.shape[0]}")
    return full.detach().chunk(n_shards, dim=0)[index].clone()


class ColumnParallelLinear(nn.Module):
    """y_BL(O/p) = x_BLD A_rᵀ: this rank's output features. `gather_output` all-gathers them.

    `from_full(..., shard=(index, n_shards))` picks which row block of the full weight this
    rank holds (for k/v heads replicated across ranks); by default (tp rank, tp)."""

    def __init__(self, weight_OD: torch.Tensor, bias_O: torch.Tensor | None = None, *, group,
                 entry: Entry = "copy", gather_output: bool = False,
                 counter: CommCounter | None = None):
        super().__init__()
        self.group, self.entry, self.counter = group, entry, counter
        self.gather_output = gather_output
        self.weight = nn.Parameter(weight_OD)
        self.bias = None if bias_O is None else nn.Parameter(bias_O)
        self.out_features, self.in_features = weight_OD.shape
        self.wgrad_queue: WeightGradQueue | None = None
        self.fp8: Fp8Spec | None = None  # set by hpctrain.parallel.fp8.apply_fp8

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
                  shard: tuple[int, int] | None = None, **kw) -> ColumnParallelLinear:
        index, n = shard if shard is not None else (_rank(group), _size(group))
        b = None if bias is None else shard_rows(bias, index=index, n_shards=n)
        return cls(shard_rows(weight, index=index, n_shards=n), b, group=group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter(x, self.entry, self.group, self.counter)
        y = linear(x, self.weight, self.bias, queue=self.wgrad_queue, fp8=self.fp8)
        return gather_last(y, group=self.group, counter=self.counter) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features(local)={self.out_features}, "
                f"entry={self.entry}, tp={_size(self.group)}")


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r A_rᵀ (+ b once, after the reduction); x_r is this rank's input slice."""

    def __init__(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None = None, *, group,
                 exit: Exit = "reduce", counter: CommCounter | None = None):
        super().__init__()
        self.group, self.exit, self.counter = group, exit, counter
        self.weight = nn.Parameter(weight_OI)
        self.bias = None if bias_O is None else nn.Parameter(bias_O)  # replicated
        self.out_features, self.in_features = weight_OI.shape
        self.wgrad_queue: WeightGradQueue | None = None
        self.fp8: Fp8Spec | None = None  # set by hpctrain.parallel.fp8.apply_fp8

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group,
                  **kw) -> RowParallelLinear:
        cols = shard_rows(weight.t(), index=_rank(group), n_shards=_size(group)).t()
        b = None if bias is None else bias.detach().clone()
        return cls(cols.contiguous(), b, group=group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, queue=self.wgrad_queue, fp8=self.fp8)
        if self.exit == "reduce":
            y = reduce_from_tp(y, group=self.group, counter=self.counter)
        else:
            y = reduce_scatter_seq(y, group=self.group, counter=self.counter)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features(local)={self.in_features}, out_features={self.out_features}, "
                f"exit={self.exit}, tp={_size(self.group)}")


class VocabParallelEmbedding(nn.Module):
    """h_BLD = Σ_r E_r[t] where E_r holds vocabulary rows [r·v, (r+1)·v) and tokens outside
    them contribute zeros; the sum is an all-reduce, or a reduce-scatter to h_BlD with sp."""

    def __init__(self, weight_vD: torch.Tensor, *, group, exit: Exit = "reduce",
                 counter: CommCounter | None = None):
        super().__init__()
        self.group, self.exit, self.counter = group, exit, counter
        self.weight = nn.Parameter(weight_vD)
        self.vocab_start = _rank(group) * weight_vD.shape[0]

    @classmethod
    def from_full(cls, weight_VD: torch.Tensor, *, group, **kw) -> VocabParallelEmbedding:
        return cls(shard_rows(weight_VD, index=_rank(group), n_shards=_size(group)),
                   group=group, **kw)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        local_BL = tokens_BL - self.vocab_start
        outside_BL = (local_BL < 0) | (local_BL >= self.weight.shape[0])
        h_BLD = F.embedding(local_BL.masked_fill(outside_BL, 0), self.weight)
        h_BLD = h_BLD.masked_fill(outside_BL.unsqueeze(-1), 0.0)
        if self.exit == "reduce":
            return reduce_from_tp(h_BLD, group=self.group, counter=self.counter)
        return reduce_scatter_seq(h_BLD, group=self.group, counter=self.counter)


class ParallelEntryRMSNorm(RMSNorm):
    """RMSNorm (replicated gain) followed by the tp entry collective of the column-parallel
    layers that consume it, so wq/wk/wv (or w1/w3) share one f or one all-gather."""

    def __init__(self, dim: int, *, eps: float, group, entry: Entry,
                 counter: CommCounter | None = None):
        super().__init__(dim, eps=eps)
        self.group, self.entry, self.counter = group, entry, counter

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return _enter(super().forward(x_BLD), self.entry, self.group, self.counter)

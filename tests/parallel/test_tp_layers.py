"""Tensor-parallel layers and loss against single-process references (fp64, 1e-12)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.parallel.tensor import (
    ColumnParallelLinear,
    CommCounter,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_last,
    scatter_seq,
    split_last,
    vocab_parallel_cross_entropy,
)
from tests.parallel.tp_reference import max_err, shard, tp_group

TOL = 1e-12
B, L, D, O = 2, 8, 12, 16


def _data(*shapes):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _column(sp: bool, gather_output: bool):
    group = tp_group()
    x, w, r = _data((B, L, D), (O, D), (B, L, O))
    x_ref = x.clone().requires_grad_()
    w_ref = w.clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref)
    (y_ref * r).sum().backward()
    layer = ColumnParallelLinear.from_full(w, group=group, gather_output=gather_output,
                                           entry="gather_seq" if sp else "copy")
    x_par = x.clone().requires_grad_()
    y = layer(scatter_seq(x_par, group=group) if sp else x_par)
    y_want = y_ref if gather_output else shard(y_ref, -1)
    (y * (r if gather_output else shard(r, -1))).sum().backward()
    return [max_err(y, y_want), max_err(x_par.grad, x_ref.grad),
            max_err(layer.weight.grad, shard(w_ref.grad, 0))]


def _row(sp: bool):
    group = tp_group()
    x, w, r = _data((B, L, O), (D, O), (B, L, D))
    bias = torch.arange(D, dtype=torch.float64)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    b_ref = bias.clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b_ref)
    (y_ref * r).sum().backward()
    layer = RowParallelLinear.from_full(w, bias, group=group,
                                        exit="reduce_scatter_seq" if sp else "reduce")
    x_par = x.clone().requires_grad_()
    y = layer(split_last(x_par, group=group))
    y_want, r_loc = (shard(y_ref, 1), shard(r, 1)) if sp else (y_ref, r)
    (y * r_loc).sum().backward()
    b_grad = layer.bias.grad.clone()
    if sp:  # the replicated bias saw only this rank's sequence shard
        dist.all_reduce(b_grad, group=group)
    return [max_err(y, y_want), max_err(x_par.grad, x_ref.grad),
            max_err(layer.weight.grad, shard(w_ref.grad, 1)), max_err(b_grad, b_ref.grad)]


def _embedding(sp: bool):
    group = tp_group()
    (w,) = _data((64, D))
    tokens = torch.randint(0, 64, (B, L), generator=torch.Generator().manual_seed(3))
    w_ref = w.clone().requires_grad_()
    (r,) = _data((B, L, D))
    (F.embedding(tokens, w_ref) * r).sum().backward()
    emb = VocabParallelEmbedding.from_full(w, group=group,
                                           exit="reduce_scatter_seq" if sp else "reduce")
    h = emb(tokens)
    want = F.embedding(tokens, w)
    want, r_loc = (shard(want, 1), shard(r, 1)) if sp else (want, r)
    (h * r_loc).sum().backward()
    return [max_err(h, want), max_err(emb.weight.grad, shard(w_ref.grad, 0))]


def _loss():
    group = tp_group()
    (logits,) = _data((B, L, 64))
    targets = torch.randint(0, 64, (B, L), generator=torch.Generator().manual_seed(5))
    ref = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(ref.flatten(0, 1), targets.flatten())
    loss_ref.backward()
    local = shard(logits, -1).clone().requires_grad_()
    counter = CommCounter()
    loss = vocab_parallel_cross_entropy(local, targets, group=group, counter=counter)
    loss.backward()
    p, T = dist.get_world_size(), B * L
    assert counter.total == 2 * (p - 1) * 3 * T * 8 // p  # fp64: 3 numbers per token
    return [abs(float(loss) - float(loss_ref)), max_err(local.grad, shard(ref.grad, -1))]


def _gather_split_roundtrip():
    group = tp_group()
    (x,) = _data((B, L, O))
    x = x.requires_grad_()
    y = gather_last(split_last(x, group=group), group=group)
    (y * 2).sum().backward()
    return [max_err(y, x), max_err(x.grad, torch.full_like(x, 2.0))]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_column_parallel(size, sp, world2, world4):
    world = {2: world2, 4: world4}[size]
    for gather_output in (False, True):
        for errs in world.run(_column, sp, gather_output):
            assert max(errs) < TOL, errs


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_row_parallel(size, sp, world2, world4):
    for errs in {2: world2, 4: world4}[size].run(_row, sp):
        assert max(errs) < TOL, errs


@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding(sp, world4):
    for errs in world4.run(_embedding, sp):
        assert max(errs) < TOL, errs


@pytest.mark.parametrize("size", [2, 4])
def test_vocab_parallel_cross_entropy(size, world2, world4):
    for errs in {2: world2, 4: world4}[size].run(_loss):
        assert max(errs) < TOL, errs


def test_gather_split_conjugate(world2):
    for errs in world2.run(_gather_split_roundtrip):
        assert max(errs) == 0.0, errs

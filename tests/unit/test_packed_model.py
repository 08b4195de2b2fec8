"""A packed row through the whole model gives exactly what each document gives alone (fp64):
per-token losses, and the gradients of their sum; padding (IGNORE_INDEX) adds nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpctrain.models import build_model
from hpctrain.models.config import ModelConfig
from hpctrain.models.llama.model import block_rope
from hpctrain.ops.documents import IGNORE_INDEX, Documents

TOL = 1e-12
LENGTHS = [5, 1, 9, 3]  # a document of length 1, and a row of several


def _cfg(attention: str) -> ModelConfig:
    return ModelConfig(name="debug", vocab_size=64, dim=16, n_layers=2, n_heads=4,
                       n_kv_heads=2, ffn_dim=32, max_seq_len=32, attention=attention)


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 64, (1, n + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _losses_and_grads(model, inputs_BL, targets_BL, docs):
    model.zero_grad()
    logits = model(inputs_BL, docs=docs)
    per_token = F.cross_entropy(logits.flatten(0, 1), targets_BL.flatten(), reduction="none")
    per_token.sum().backward()
    return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_row_equals_each_document_alone(attention):
    model = build_model(_cfg(attention), seed=5).double()
    inputs, targets = _tokens(sum(LENGTHS))
    ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]
    packed, packed_grads = _losses_and_grads(model, inputs, targets, Documents.from_ids(ids))
    alone = []
    summed = {n: torch.zeros_like(g) for n, g in packed_grads.items()}
    start = 0
    for n in LENGTHS:
        part = slice(start, start + n)
        loss, grads = _losses_and_grads(model, inputs[:, part], targets[:, part], None)
        alone.append(loss)
        for name, g in grads.items():
            summed[name] += g
        start += n
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=TOL)
    for name, g in packed_grads.items():
        torch.testing.assert_close(g, summed[name], rtol=0, atol=TOL, msg=name)
    # The comparison can tell: the same row without document masks differs.
    unmasked, _ = _losses_and_grads(model, inputs, targets, None)
    assert (unmasked - packed).abs().max() > 1e-6


def test_padding_adds_no_loss_and_no_gradient():
    """A row padded after its documents (targets IGNORE_INDEX, a document of its own) has the
    mean loss and gradients of the unpadded row."""
    model = build_model(_cfg("sdpa"), seed=5).double()
    inputs, targets = _tokens(10)
    ids = torch.tensor([[0] * 4 + [1] * 6])
    model.zero_grad()
    F.cross_entropy(model(inputs, docs=Documents.from_ids(ids)).flatten(0, 1),
                    targets.flatten()).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    pad = 6
    inputs_p = torch.cat([inputs, torch.full((1, pad), 7)], dim=1)
    targets_p = torch.cat([targets, torch.full((1, pad), IGNORE_INDEX)], dim=1)
    ids_p = torch.cat([ids, torch.full((1, pad), 2)], dim=1)
    model.zero_grad()
    F.cross_entropy(model(inputs_p, docs=Documents.from_ids(ids_p)).flatten(0, 1),
                    targets_p.flatten()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=0, atol=TOL, msg=name)


def test_positions_restart_at_each_document():
    """Every block rotates a token by its offset inside its own document. (RoPE scores depend
    only on i − j, so with document masks the model's output would match with row positions
    too in exact arithmetic; the angles themselves are what restarting changes: smaller, more
    precise angles in 16 bits, and no position beyond the longest document.)"""
    model = build_model(_cfg("eager"), seed=5).double()
    tables = model.rope(torch.device("cpu"))
    docs = Documents.from_ids(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))
    cos, sin = block_rope(tables, docs)
    want = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])
    assert cos.shape == (1, 1, 8, tables[0].shape[1])
    torch.testing.assert_close(cos[0, 0], tables[0][want], rtol=0, atol=0)
    torch.testing.assert_close(sin[0, 0], tables[1][want], rtol=0, atol=0)
    row_cos, _ = block_rope(tables, None)
    torch.testing.assert_close(row_cos[:8], tables[0][:8], rtol=0, atol=0)

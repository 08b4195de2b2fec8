"""Choosing the next token from the model's logits (task=generate).

Legend: B batch, V vocabulary, S vocabulary sorted by probability.
temperature 0 is greedy: argmax of the logits. Otherwise the logits are divided by the
temperature, the top_k likeliest tokens kept (0: all), then the smallest set of likeliest
tokens whose probability reaches top_p (1: all; the likeliest token always stays), and one
token is drawn from the renormalised softmax with the given torch.Generator, so a seed
gives the same tokens again. Ids at or past `vocab` (rows of a padded embedding that no
tokenizer id names) are never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    vocab: int | None = None  # ids ≥ vocab are never chosen; None: every id of the logits


def next_token(logits_BV: torch.Tensor, s: Sampling,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """tokens_B chosen from logits_BV by `s` (module docstring)."""
    logits_BV = logits_BV.float()
    if s.vocab is not None and s.vocab < logits_BV.shape[-1]:
        logits_BV = logits_BV.clone()
        logits_BV[:, s.vocab:] = float("-inf")
    if s.temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / s.temperature
    if 0 < s.top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, s.top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if s.top_p < 1:
        logits_BV = _nucleus(logits_BV, s.top_p)
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]


def _nucleus(logits_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop every token whose likelier tokens already hold top_p of the probability."""
    sorted_BS, order_BS = torch.sort(logits_BV, dim=-1, descending=True)
    probs_BS = torch.softmax(sorted_BS, dim=-1)
    before_BS = probs_BS.cumsum(dim=-1) - probs_BS  # the mass of the likelier tokens
    drop_BS = before_BS >= top_p
    drop_BV = torch.zeros_like(drop_BS).scatter(-1, order_BS, drop_BS)
    return logits_BV.masked_fill(drop_BV, float("-inf"))

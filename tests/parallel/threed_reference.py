"""Shared helpers for the 3D (dp × tp × pp) tests: a tiny fp64 model, micro-batches, the
single-process reference and this rank's slice of a full-model tensor under the tp plan."""

from __future__ import annotations

import torch

from hpctrain.models.config import ModelConfig
from tests import references

SEED, MB, SEQ = 7, 2, 8


def model_cfg(n_layers: int, *, n_kv_heads: int = 2) -> ModelConfig:
    return ModelConfig(name="debug", vocab_size=64, dim=16, n_layers=n_layers, n_heads=4,
                       n_kv_heads=n_kv_heads, ffn_dim=32, max_seq_len=SEQ, attention="eager")


def micro_batches(m: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return references.micro_batches(m, MB, SEQ, vocab=vocab, seed=SEED)


def reference(cfg: ModelConfig, micro) -> tuple[float, dict[str, torch.Tensor], float]:
    """(mean loss, full gradients by name, gradient norm) of the single-process fp64 model."""
    loss, grads = references.fp64_grads(cfg, micro, seed=SEED)
    return loss, grads, references.grad_norm(grads)


def expected_slice(name: str, full: torch.Tensor, cfg: ModelConfig, *, tp: int,
                   tp_rank: int) -> torch.Tensor:
    """Rank `tp_rank`'s slice of a full-model tensor: wo/w2 by input columns, k/v by kv head
    (replicated on tp/K ranks when K < tp), norms whole, everything else by output rows."""
    if name.endswith(("wo.weight", "w2.weight")):
        return full.chunk(tp, dim=1)[tp_rank]
    if name.endswith(("wk.weight", "wv.weight")) and cfg.n_kv_heads % tp:
        return full.chunk(cfg.n_kv_heads, dim=0)[tp_rank // (tp // cfg.n_kv_heads)]
    if name.endswith("norm.weight"):
        return full
    return full.chunk(tp, dim=0)[tp_rank]

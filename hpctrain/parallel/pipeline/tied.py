"""Tied input embedding and output head across pipeline stages.

With `model.tied_embeddings` the single process has one matrix E (V × D, or its vocab shard
under tp) used by the token embedding and by the output head. In a pipeline the first stage
holds the embedding and the last stage the head:

- same rank (zbv puts stages 0 and S-1 on pp rank 0): one Parameter, exactly as the single
  process (`stage.tie_parts`); nothing to communicate.
- different ranks: each holds a copy of E with the same initial value (the head is initialised
  from the embedding's name); after the schedule, `TiedEmbeddings.sum_grads` all-reduces the
  copy's gradient over the group {pp rank 0, last pp rank} of this rank's dp/tp coordinate, so
  both copies see ∂L/∂E = ∂L/∂E_embed + ∂L/∂E_head and — with the same optimizer — stay equal.
  The clip norm counts E once (`replicas`: the copy is held by 2 ranks of the pp group).

Checkpoints keep E once under the single process's name: the last stage's copy is registered
in `LocalStages` under the embedding's name too (`HeadAlias`), so named parameters, DCP keys and
the optimizer's names are the pp=1 model's and a checkpoint resumes at any pp.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch import nn

from hpctrain.distributed.dims import ParallelDims
from hpctrain.models.registry import family_of


class HeadAlias(nn.Module):
    """Registers the last stage's head weight under the embedding's name on a rank
    without the first stage (no forward: the head module itself computes)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


def tied_group(dims: ParallelDims, rank: int, *, timeout_s: float):
    """The process group {pp rank 0, last pp rank} of `rank`'s dp/tp coordinate, or None when
    `rank` is in no such pair. Collective: every rank creates every pair, in the same order."""
    mine = None
    for ranks in dims.all_groups("pp"):
        pair = [ranks[0], ranks[-1]]
        group = dist.new_group(pair, timeout=datetime.timedelta(seconds=timeout_s))
        if rank in pair:
            mine = group
    return mine


class TiedEmbeddings:
    """This rank's copy of E (`weight`) and the pair group it is summed over. `group` is None
    when there is no pair (first and last stage on this rank: one Parameter, nothing to sum);
    it is not a mesh axis, and None never stands for the world here."""

    def __init__(self, weight: nn.Parameter, *, group):
        self.weight, self.group = weight, group

    @property
    def split(self) -> bool:
        """E is held by two ranks (a copy each), whose gradients must be summed."""
        return self.group is not None

    @property
    def replicas(self) -> dict[int, int]:
        """{id(E): 2} when E is held by two pp ranks (each counts ‖g‖²/2 in the clip norm)."""
        return {id(self.weight): 2} if self.split else {}

    def sum_grads(self) -> None:
        """Σ of both copies' gradients on both ranks; call before the dp reduction."""
        if self.split and self.weight.grad is not None:
            dist.all_reduce(self.weight.grad, group=self.group)


def build_tied(local, *, dims: ParallelDims, rank: int, n_stages: int, pp_ranks_apart: bool,
               timeout_s: float) -> TiedEmbeddings | None:
    """The tied weight of `local` (LocalStages) on ranks that hold the first or last stage.
    `pp_ranks_apart`: the first and last stage live on different pp ranks (not zbv); then the
    pair groups are created (on every rank, collectively)."""
    group = tied_group(dims, rank, timeout_s=timeout_s) if pp_ranks_apart else None
    family, parts = family_of(local.cfg), local.parts
    if 0 in parts:
        return TiedEmbeddings(getattr(parts[0], family.embedding).weight, group=group)
    if n_stages - 1 in parts:
        return TiedEmbeddings(getattr(parts[n_stages - 1], family.head).weight, group=group)
    return None


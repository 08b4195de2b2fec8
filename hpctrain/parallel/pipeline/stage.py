"""Pipeline stages: the model's own parts, one per stage, under the whole model's names.

Stage s of S is the part of the model its family builds for layers [s·L/S, (s+1)·L/S)
(`hpctrain.models.family.Part.stage`): stage 0 with the embedding, stage S-1 with the final norm
and the head, each run by the model's own forward. Nothing here names a module: the family
says where the blocks and the two ends live. Blocks are keyed by their global index, so a
stage's parameter names (e.g. `layers.5.attn.wq.weight`) and, through the name-keyed
init, its values equal the single-process model's; checkpoints and comparisons line up across
pipeline layouts. The loss is not part of a stage: the runtime applies the step's loss function
(the vocab-parallel one under tp) to the last stage's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from hpctrain.distributed.mesh import group_size
from hpctrain.models import build_model
from hpctrain.models.config import ModelConfig
from hpctrain.models.family import ModelFamily, Part
from hpctrain.models.registry import family_of
from hpctrain.ops.linear import WeightGradQueue
from hpctrain.parallel.pipeline.tied import HeadAlias
from hpctrain.parallel.pipeline.tp_stages import shard_parts
from hpctrain.parallel.tensor.plan import TensorParallelPlan


@dataclass
class Stage:
    """One stage this rank runs: its `module` (the model part) and its weight-gradient queue,
    which every layer of the module that can defer its weight gradient points at (the
    zero-bubble schedules run those gradients in their W actions)."""

    index: int
    module: nn.Module
    is_first: bool
    is_last: bool
    wgrad_queue: WeightGradQueue = field(default_factory=WeightGradQueue)

    def attach_wgrad_queue(self) -> None:
        """Point the module's deferrable layers at this stage's queue; call once the module's
        layers are final (after tensor parallelism replaced them)."""
        for module in self.module.modules():
            if hasattr(module, "wgrad_queue"):
                module.wgrad_queue = self.wgrad_queue


class LocalStages(nn.Module):
    """The stages one rank holds, exposed under the whole model's names.

    Registers the parts' embedding, blocks, final norm and head directly (the same module
    objects, under the family's names), so `named_parameters`, `state_dict` and DCP checkpoints
    use the single-process names; `parts` maps stage index → module (plain dict: not
    registered twice) and `stages` stage index → `Stage` for the runtime. Build it once the
    parts' modules are final (after tensor parallelism and tying).
    """

    def __init__(self, parts: dict[int, nn.Module], *, n_stages: int, cfg):
        super().__init__()
        self.cfg = cfg
        family = family_of(cfg)
        self.parts = dict(sorted(parts.items()))
        self.stages = {s: Stage(s, part, is_first=s == 0, is_last=s == n_stages - 1)
                       for s, part in self.parts.items()}
        for stage in self.stages.values():
            stage.attach_wgrad_queue()
        self.add_module(family.blocks, nn.ModuleDict())
        blocks = getattr(self, family.blocks)
        last = self.parts.get(n_stages - 1)
        if last is not None and cfg.tied_embeddings and 0 not in self.parts:
            # one name for E: the head's copy is saved as the embedding (parallel.pipeline.tied)
            self.add_module(family.embedding, HeadAlias(getattr(last, family.head).weight))
        for part in self.parts.values():
            for name in (family.embedding, family.norm, family.head):
                if getattr(part, name, None) is not None:
                    self.add_module(name, getattr(part, name))
            blocks.update(getattr(part, family.blocks))


def stage_parts(cfg: ModelConfig, stage_ids, *, n_stages: int, seed: int
                ) -> dict[int, nn.Module]:
    """The model's parts for `stage_ids` (stage index → part), initialised as the whole model."""
    return {s: build_model(cfg, seed=seed,
                           part=Part.stage(s, n_stages=n_stages, n_layers=cfg.n_layers))
            for s in stage_ids}


def assemble_stages(parts: dict[int, nn.Module], *, n_stages: int,
                    cfg: ModelConfig) -> LocalStages:
    """Tie a head to the embedding held on the same rank, then expose the parts as one module
    under the whole model's names. Call once the parts' modules are final (after tp)."""
    if cfg.tied_embeddings:
        tie_parts(parts, n_stages=n_stages, family=family_of(cfg))
    return LocalStages(parts, n_stages=n_stages, cfg=cfg)


def build_local_stages(cfg: ModelConfig, stage_ids, *, n_stages: int, seed: int,
                       tp_group: dist.ProcessGroup, sp: bool = False
                       ) -> tuple[LocalStages, TensorParallelPlan | None]:
    """This rank's stages (`stage_ids`, from `Schedule.stages_of(pp_rank)`), tp-sharded over
    `tp_group` when it has more than one rank, and the plan that sharded them (None at tp = 1):
    the first steps of `hpctrain.train.setup.build_rank_model`, in its order, for runs of the
    runtime without the trainer (no ep, fp8, cp, checkpointing or compile)."""
    parts = stage_parts(cfg, stage_ids, n_stages=n_stages, seed=seed)
    plan = (shard_parts(parts, group=tp_group, sp=sp, cfg=cfg)
            if group_size(tp_group) > 1 else None)
    return assemble_stages(parts, n_stages=n_stages, cfg=cfg), plan


def tie_parts(parts: dict[int, nn.Module], *, n_stages: int, family: ModelFamily) -> None:
    """First and last stage on this rank with tied embeddings: the head uses the embedding's
    Parameter, exactly as the single-process model (after tensor parallelism: the shards)."""
    first, last = parts.get(0), parts.get(n_stages - 1)
    if first is not None and last is not None and first is not last:
        getattr(last, family.head).weight = getattr(first, family.embedding).weight

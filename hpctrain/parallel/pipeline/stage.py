"""Pipeline stages: the Transformer cut by layer, with the full model's parameter names.

Stage s of S holds layers [s·L/S, (s+1)·L/S); stage 0 also holds `tok_embeddings`, stage S-1 the
final `norm`, the `output` head and the loss (with tied embeddings the head is a copy of the
embedding, or the same Parameter on one rank: hpctrain.parallel.pipeline.tied). Blocks are the
Transformer's own `Block`s, kept in a ModuleDict keyed by their global index, so a stage's
parameter names (`layers.5.attn.wq.weight`) and — through the name-keyed init — its values equal
the single-process model's. Checkpoints and comparisons therefore line up across pipeline
layouts.

Legend: B micro-batch, L sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.distributed.mesh import group_size
from hpctrain.models.config import ModelConfig
from hpctrain.models.init import full_init, init_weights
from hpctrain.models.llama import Block, block_rope
from hpctrain.ops.documents import Documents
from hpctrain.ops.linear import Linear, WeightGradQueue
from hpctrain.ops.norms import RMSNorm
from hpctrain.ops.rope import rope_tables
from hpctrain.parallel.pipeline.tied import HeadAlias, tie_local_stages
from hpctrain.parallel.pipeline.tp_stages import shard_stages
from hpctrain.parallel.step import lm_loss
from hpctrain.parallel.tensor.plan import TensorParallelPlan


def stage_layers(stage: int, *, n_stages: int, n_layers: int) -> range:
    """Layer indices of `stage`: [s·L/S, (s+1)·L/S)."""
    if n_layers % n_stages:
        raise ValueError(f"model.n_layers={n_layers} is not divisible by {n_stages} pipeline "
                         f"stages (pp × virtual_stages): choose a divisor of the layer count")
    per = n_layers // n_stages
    return range(stage * per, (stage + 1) * per)


class PipelineStage(nn.Module):
    """tokens_BL (stage 0) or h_BLD → h_BLD, or on the last stage → mean loss over tokens.

    Owns a `WeightGradQueue` attached to every submodule with a `wgrad_queue` attribute
    (hpctrain Linears, and the tensor-parallel layers after `attach_wgrad_queue`), so the
    runtime can defer the weight gradients of a B action and run them in the matching W action.
    `loss_fn(logits, targets)` is the last stage's loss (the vocab-parallel one under tp).
    """

    def __init__(self, cfg: ModelConfig, *, stage: int, n_stages: int, seed: int):
        super().__init__()
        self.cfg, self.stage, self.n_stages = cfg, stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        idx = stage_layers(stage, n_stages=n_stages, n_layers=cfg.n_layers)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if self.is_first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in idx})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps) if self.is_last else None
        self.output = Linear(cfg.dim, cfg.vocab_size, bias=False) if self.is_last else None
        init_weights(self, cfg, seed=seed)
        if cfg.tied_embeddings and self.is_last:  # a copy of E (hpctrain...pipeline.tied)
            e = full_init("tok_embeddings.weight", self.output.weight.shape, cfg, seed=seed)
            with torch.no_grad():
                self.output.weight.copy_(e)
        self.wgrad_queue = WeightGradQueue()
        self.attach_wgrad_queue()
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def attach_wgrad_queue(self) -> None:
        """Point every layer that can defer its weight gradient at this stage's queue; call it
        again after replacing modules (e.g. by their tensor-parallel shards)."""
        for module in self.modules():
            if module is not self and hasattr(module, "wgrad_queue"):
                module.wgrad_queue = self.wgrad_queue

    def rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].device != device:
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len,
                                   theta=self.cfg.rope_theta, scaling=self.cfg.rope_scaling)
            self._rope = (cos.to(device), sin.to(device))
        return self._rope

    def forward(self, x: torch.Tensor, targets_BL: torch.Tensor | None = None, *,
                docs: Documents | None = None) -> torch.Tensor:
        """`docs`: the micro-batch's document boundaries, which every stage reads from the
        micro-batch itself (all stages of a replica read the same one), so they need no p2p."""
        h_BLD = self.tok_embeddings(x) if self.is_first else x
        rope = block_rope(self.rope(h_BLD.device), docs)
        for block in self.layers.values():
            h_BLD = block(h_BLD, rope, docs)
        if not self.is_last:
            return h_BLD
        logits_BLV = self.output(self.norm(h_BLD))
        if targets_BL is None:
            return logits_BLV
        return self.loss_fn(logits_BLV, targets_BL)


class LocalStages(nn.Module):
    """The stages one rank holds, exposed under the full model's names.

    Registers the stages' `tok_embeddings`, `layers.<i>`, `norm` and `output` directly (the same
    module objects), so `named_parameters`, `state_dict` and DCP checkpoints use the
    single-process names; `stages` maps stage index → PipelineStage for the runtime.
    """

    def __init__(self, stages: dict[int, PipelineStage]):
        super().__init__()
        self.stages = dict(sorted(stages.items()))  # a plain dict: not registered twice
        self.layers = nn.ModuleDict()
        for st in self.stages.values():
            if st.is_last and st.cfg.tied_embeddings and 0 not in self.stages:
                self.add_module("tok_embeddings", HeadAlias(st.output.weight))  # one name for E
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(st, name) is not None:
                    self.add_module(name, getattr(st, name))
            self.layers.update(st.layers)


def build_local_stages(cfg: ModelConfig, stage_ids, *, n_stages: int, seed: int,
                       tp_group: dist.ProcessGroup, sp: bool = False
                       ) -> tuple[LocalStages, TensorParallelPlan | None]:
    """This rank's stages (`stage_ids`, from `Schedule.stages_of(pp_rank)`), initialised, and
    the tensor-parallel plan that sharded them: with a `tp_group` of size > 1 each stage is
    replaced by its tp shard (`hpctrain.parallel.pipeline.tp_stages`), else the plan is None.
    The caller keeps the plan (it is not stored on the modules)."""
    stages = {s: PipelineStage(cfg, stage=s, n_stages=n_stages, seed=seed) for s in stage_ids}
    plan = None
    if group_size(tp_group) > 1:
        plan = shard_stages(stages, group=tp_group, sp=sp, cfg=cfg)
    tie_local_stages(stages, n_stages=n_stages)  # after sharding: tie the shards
    return LocalStages(stages), plan

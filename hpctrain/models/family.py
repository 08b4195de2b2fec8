"""What a model family declares, so the parallel code finds its parts without naming them.

The parallel layers (tensor, pipeline, context, data) and the trainer never spell a module name
of a model: they ask its family. A family declares

- how to build a *part*: the blocks of a range of layers, with or without the embedding and the
  head. The whole model is the part with every layer and both ends; a pipeline stage is the part
  of its layers. Parameter names are the whole model's in every part (blocks are keyed by their
  global layer index), so deterministic init, checkpoints and comparisons line up across layouts;
- where the blocks, the embedding, the final norm and the output head live, and where in a block
  its attention core is (context parallelism swaps it for ring attention);
- its tensor-parallel plan: a table of module names (inside a block, and the two ends) to shard
  styles, the key/value projections split by kv head, and the dense MLP a mixture-of-experts
  block leaves whole.

Adding a family (another block shape, other names) is one `ModelFamily` next to its modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from hpctrain.models.config import ModelConfig

# How tensor parallelism shards a module (hpctrain.parallel.tensor.plan implements each):
# column/row-parallel linears, a vocab-parallel embedding, a replicated norm that is also the
# entry collective of the column layers after it, and a norm inside the heads (q/k norm):
# whole on every rank, its gradient the sum over the ranks' heads.
Style = Literal["column", "row", "vocab", "entry_norm", "head_norm"]


@dataclass(frozen=True)
class Part:
    """The layers [layers.start, layers.stop) of a model, with the token embedding (`embed`)
    and the final norm + output head (`head`) or without them."""

    layers: range
    embed: bool = True
    head: bool = True

    @classmethod
    def whole(cls, cfg: ModelConfig) -> Part:
        return cls(range(cfg.n_layers))

    @classmethod
    def stage(cls, stage: int, *, n_stages: int, n_layers: int) -> Part:
        """Pipeline stage `stage` of `n_stages`: layers [s·L/S, (s+1)·L/S); stage 0 embeds,
        the last stage holds the head."""
        if n_stages < 1 or not 0 <= stage < n_stages:
            raise ValueError(f"stage {stage} of {n_stages}: need 0 <= stage < n_stages")
        if n_layers % n_stages:
            raise ValueError(f"model.n_layers={n_layers} is not divisible by {n_stages} "
                             "pipeline stages (pp × virtual_stages): choose a divisor of the "
                             "layer count")
        per = n_layers // n_stages
        return cls(range(stage * per, (stage + 1) * per), embed=stage == 0,
                   head=stage == n_stages - 1)


@dataclass(frozen=True)
class ModelFamily:
    """A model family's declaration (module docstring). Names are attribute paths: `blocks`,
    `embedding`, `norm` and `head` on the model (or part), `attention_core` and the tp tables'
    keys inside one block."""

    name: str
    build: Callable[[ModelConfig, Part], nn.Module]  # the part, uninitialised
    blocks: str
    embedding: str
    norm: str
    head: str
    attention_core: str
    tp_block: Mapping[str, Style]
    tp_ends: Mapping[str, Style]
    tp_kv: tuple[str, ...]  # column layers split by kv head (replicated when kv heads < tp)
    block_mlp: str  # the block's MLP: an MoE block keeps it whole on every tp rank

    def block_items(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(global layer index, block) of the layers `model` holds, in order."""
        return list(getattr(model, self.blocks).named_children())

    def planned_style(self, module: str) -> Style | None:
        """The tp table's style for a whole-model module name (None: not planned, so
        replicated on every tp rank)."""
        head, _, rest = module.partition(".")
        if head == self.blocks:  # <blocks>.<i>.<name in the block>
            return self.tp_block.get(rest.partition(".")[2])
        return self.tp_ends.get(module)

    def is_kv(self, module: str) -> bool:
        head, _, rest = module.partition(".")
        return head == self.blocks and rest.partition(".")[2] in self.tp_kv

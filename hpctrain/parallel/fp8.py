"""Turn on float8 GEMMs (`hpctrain.ops.fp8`) in a built model's linears, by name.

Every hpctrain linear has an `fp8` attribute (None: its usual bf16/fp32 path). `apply_fp8`
sets it to an `Fp8Spec` on each `Linear`, `ColumnParallelLinear` and `RowParallelLinear`, and
on each group of routed experts (`Experts`, whole on the ranks holding them: unsharded specs),
whose module name matches no `skip` pattern, telling the tp-sharded ones which weight dim is
split over which group so their scales equal the single process's. Parameters, their names
and state dicts do not change: checkpoints written with FP8 on load with it off and back.
Call it after tensor parallelism and before activation checkpointing (so names are the
model's own); embeddings are not linears and stay in their dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from fnmatch import fnmatch

from torch import nn

from hpctrain.models.moe.layer import Experts
from hpctrain.ops.fp8 import Fp8Spec, Recipe
from hpctrain.ops.linear import Linear
from hpctrain.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

log = logging.getLogger(__name__)


def skipped(name: str, skip: Sequence[str]) -> bool:
    """Whether `name` (e.g. layers.0.attn.wq, or stages.1.output) matches a skip pattern,
    as a whole or as its dotted tail (so "output" names the head in any stage)."""
    return any(fnmatch(name, p) or fnmatch(name, "*." + p) for p in skip)


def spec_for(module: nn.Module, *, recipe: Recipe) -> Fp8Spec | None:
    """The FP8 spec of an hpctrain linear or routed-expert group (None for anything else; the
    MoE router stays in fp32)."""
    if isinstance(module, ColumnParallelLinear):
        return Fp8Spec(recipe, sharded="out", group=module.group)
    if isinstance(module, RowParallelLinear):
        return Fp8Spec(recipe, sharded="in", group=module.group)
    if isinstance(module, Linear | Experts):  # experts are whole on every rank that holds them
        return Fp8Spec(recipe)
    return None


def apply_fp8(model: nn.Module, *, recipe: Recipe, skip: Sequence[str]) -> list[str]:
    """Set `fp8` on every hpctrain linear of `model` not matched by `skip`; return their
    names. Idempotent; `recipe` "tensorwise" or "rowwise" (see hpctrain.ops.fp8)."""
    done, kept = [], []
    for name, module in model.named_modules():
        spec = spec_for(module, recipe=recipe)
        if spec is None:
            continue
        if skipped(name, skip):
            kept.append(name)
            continue
        module.fp8 = spec
        done.append(name)
    log.info("FP8 (%s) on %d linears and expert groups; kept in high precision: %s", recipe,
             len(done),
             ", ".join(kept) or "none")
    return done

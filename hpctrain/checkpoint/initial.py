"""Initial weights from the seed, computed per rank into its own shards.

A rank's model is built on the meta device and sharded (tp, pp, ep, ZeRO) before anything is
materialised (hpctrain.train.setup); the data-parallel engine then gives the rank's flat units
their memory. This fills them as a checkpoint load does (`checkpoint.shards.unit_chunks`: its
boxes of every full tensor, as views of its fp32 master shards), the source being the
single-process initialisation (`hpctrain.models.init.full_init`, a pure function of the seed and
the parameter's name): each parameter's full value is computed once, its boxes copied out, and
it is dropped before the next one, so the largest transient is one full parameter in fp32
(`largest_parameter_bytes`). The compute parameters are then rebuilt from the masters
(`refresh_from_masters`, which all-gathers them at ZeRO 1 and 2). Every element equals what
building the whole model gives it, bit for bit, at any layout.

A head tied to the embedding (`model.tied_embeddings`) that a pipeline stage holds apart from
the embedding is a copy under the embedding's name (hpctrain.parallel.pipeline.tied), so it
starts as the embedding's value, as in `hpctrain.models.build_model`.
"""

from __future__ import annotations

import math

import torch

from hpctrain.checkpoint.shards import optimizer_flats, unit_chunks
from hpctrain.models.config import ModelConfig
from hpctrain.models.init import full_init
from hpctrain.parallel.data.state import refresh_from_masters
from hpctrain.parallel.state import ParallelState


@torch.no_grad()
def init_from_seed(parallel: ParallelState, cfg: ModelConfig, *, seed: int) -> None:
    """Fill this rank's master shards with the initial values (module docstring) and refresh
    the parameters (collective over each unit's group at ZeRO 1 and 2)."""
    current: tuple[str, torch.Tensor] | None = None
    for chunk in unit_chunks(parallel, optimizer_flats(parallel), copies=True):
        if chunk.path[0] != "model":
            continue
        name = chunk.path[1]
        if current is None or current[0] != name:  # chunks of one parameter come together
            current = (name, full_init(name, torch.Size(chunk.size), cfg, seed=seed))
        box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
        chunk.data.copy_(current[1][box])
    refresh_from_masters(parallel.engine, steps=0)
    for unit in parallel.engine.units:
        unit.deferred = False


def largest_parameter_bytes(parallel: ParallelState) -> int:
    """The largest transient of `init_from_seed`: one full parameter in fp32."""
    return max((4 * math.prod(s.full_shape) for s in parallel.shards.values()), default=0)

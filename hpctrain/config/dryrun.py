"""The `dryrun` group (task=dryrun, hpctrain.tasks.dryrun.run): which ranks, what tolerance."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.config.build import build
from hpctrain.config.rule import check, errors_of
from hpctrain.config.schema import Config
from hpctrain.distributed.dims import ParallelDims


@dataclass(frozen=True)
class DryrunConfig:
    """Ranks of the job to set up on meta tensors and compare with the planner."""

    ranks: tuple[int, ...] | None = None  # None: the first rank of each stage, and the last
    tolerance: float = 0.05  # |measured / predicted - 1| above it marks a term


def dryrun_settings(cfg: Config) -> DryrunConfig:
    """The `dryrun` group of `cfg.extra`; ValueError naming an unknown, mistyped or
    out-of-range key."""
    settings = build(DryrunConfig, "dryrun", cfg.extra.get("dryrun") or {})
    if not 0 < settings.tolerance < 1:
        raise ValueError(f"dryrun.tolerance={settings.tolerance} must be a fraction in (0, 1), "
                         "e.g. 0.05 for 5%")
    if settings.ranks is not None and not settings.ranks:
        raise ValueError("dryrun.ranks=[] names no rank: list global ranks, or null for the "
                         "first rank of each pipeline stage and the last")
    return settings


def default_ranks(dims: ParallelDims) -> list[int]:
    """The first global rank of each pipeline stage (every other coordinate 0), then the last
    global rank: every stage's parameters and schedule position, and the far end of the mesh."""
    firsts = [r for r in range(dims.world_size) if all(
        v == 0 for axis, v in dims.coords(r).items() if axis != "pp")][:dims.pp]
    return sorted({*firsts, dims.world_size - 1})


def chosen_ranks(cfg: Config) -> list[int]:
    """dryrun.ranks, checked against the world; ValueError naming the bad ones."""
    dims, wanted = cfg.parallel.dims, dryrun_settings(cfg).ranks
    if wanted is None:
        return default_ranks(dims)
    bad = [r for r in wanted if not 0 <= r < dims.world_size]
    if bad:
        raise ValueError(f"dryrun.ranks={list(wanted)}: {bad} outside the job's "
                         f"{dims.world_size} ranks (0..{dims.world_size - 1})")
    return sorted(set(wanted))


@check("dryrun", "parallel.", "model.moe.")
def check_dryrun(c: Config) -> list[str]:
    """task=dryrun: the dryrun.* settings and its ranks inside the job's world."""
    return errors_of(c, chosen_ranks)

"""Checks of the pipeline keys: the schedule must build for (pp, microbatches, virtual_stages)
and, on NCCL, complete under batched p2p."""

from __future__ import annotations

from hpctrain.config.rule import check, errors_of
from hpctrain.config.schema import Config
from hpctrain.config.validate.batch import BATCH, batch_refused
from hpctrain.config.validate.model import SHAPE
from hpctrain.distributed.device import resolve_device_type
from hpctrain.parallel.pipeline.batching import check_batched
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.schedules import build_schedule


def _schedule(c: Config):
    """pp > 1: the built schedule; ValueError from build_schedule on a bad combination."""
    p = c.parallel
    return build_schedule(p.schedule, pp=p.pp, microbatches=c.grad_accum,
                          virtual_stages=p.virtual_stages)


@check(*BATCH)
def check_schedule(c: Config) -> list[str]:
    """pp > 1: the schedule must build for (pp, microbatches, virtual_stages)."""
    if c.parallel.pp == 1 or batch_refused(c):
        return []
    return errors_of(c, _schedule)


@check(*BATCH, *SHAPE, "train.activation_checkpointing", "cluster.")
def check_pipeline(c: Config) -> list[str]:
    """pp = 1 leaves the pipeline keys at their defaults; pp > 1 on NCCL: the schedule must
    complete under batched p2p."""
    p = c.parallel
    if p.pp == 1:
        if p.virtual_stages != 1 or p.timeline:
            return ["parallel.virtual_stages and parallel.timeline need parallel.pp > 1: "
                    "set parallel.pp or leave them at their defaults (1, false)"]
        return []
    if batch_refused(c) or check_schedule(c):
        return []
    return nccl_p2p_problems(c, _schedule(c))


def nccl_p2p_problems(c: Config, schedule) -> list[str]:
    """On NCCL, p2p is matched by order and runs in batched groups: the lowered schedule must
    complete under those rules (hpctrain.parallel.pipeline.batching)."""
    backend = c.cluster.backend
    if backend == "auto":
        backend = "nccl" if resolve_device_type(c.cluster.device) == "cuda" else "gloo"
    if backend != "nccl":
        return []
    try:
        check_batched(lower_comm(schedule))
    except ValueError as err:
        return [f"{err} (parallel.pp={c.parallel.pp}, microbatches={c.grad_accum}): on NCCL "
                "use parallel.schedule=1f1b, zb_h1 or gpipe, or another microbatch count"]
    return []

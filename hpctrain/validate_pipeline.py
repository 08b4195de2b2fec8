"""Validation rules of the pipeline keys and task=simulate: the schedule must build for
(pp, microbatches, virtual_stages) and, on NCCL, complete under batched p2p."""

from __future__ import annotations

from hpctrain.config import Config
from hpctrain.distributed.device import resolve_device_type
from hpctrain.parallel.pipeline.batching import check_batched
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.sim_task import simulate_costs, simulated_schedule

ONE_F_ONE_B_FAMILY = ("1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv")


def _batch_refused(c: Config) -> bool:
    """check_batch refuses this batch (its fix names the batch keys): no schedule to build."""
    p, per_step = c.parallel, c.train.micro_batch_size * c.parallel.dp
    return (c.train.global_batch_size % per_step != 0 or c.grad_accum < 1
            or (p.schedule in ONE_F_ONE_B_FAMILY and c.grad_accum < p.pp))


def _schedule(c: Config):
    """pp > 1: the built schedule; ValueError from build_schedule on a bad combination."""
    p = c.parallel
    return build_schedule(p.schedule, pp=p.pp, microbatches=c.grad_accum,
                          virtual_stages=p.virtual_stages)


def check_schedule(c: Config) -> list[str]:
    """pp > 1: the schedule must build for (pp, microbatches, virtual_stages)."""
    if c.parallel.pp == 1 or _batch_refused(c):
        return []
    return _errors_of(c, _schedule)


def check_pipeline(c: Config) -> list[str]:
    """pp = 1 leaves the pipeline keys at their defaults; pp > 1 on NCCL: the schedule must
    complete under batched p2p."""
    p = c.parallel
    if p.pp == 1:
        if p.virtual_stages != 1 or p.timeline:
            return ["parallel.virtual_stages and parallel.timeline need parallel.pp > 1: "
                    "set parallel.pp or leave them at their defaults (1, false)"]
        return []
    if _batch_refused(c) or check_schedule(c):
        return []
    return _nccl_p2p_problems(c, _schedule(c))


def _nccl_p2p_problems(c: Config, schedule) -> list[str]:
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


def _errors_of(c: Config, *builders) -> list[str]:
    """Run builders that raise ValueError on bad input; collect their messages."""
    errs = []
    for build in builders:
        try:
            build(c)
        except ValueError as err:
            errs.append(str(err))
    return errs


def check_simulate(c: Config) -> list[str]:
    """task=simulate: the schedule and the simulate.* costs."""
    return _errors_of(c, simulated_schedule, simulate_costs)

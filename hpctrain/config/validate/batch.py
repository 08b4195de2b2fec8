"""Checks of the batch: the global batch splits into micro-batches over the data-parallel
ranks, and a pipeline gets as many micro-batches as its schedule needs."""

from __future__ import annotations

from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.parallel.pipeline.schedules import ONE_F_ONE_B_FAMILY

BATCH = ("train.global_batch_size", "train.micro_batch_size", "parallel.")


@check(*BATCH)
def check_batch(c: Config) -> list[str]:
    t, p = c.train, c.parallel
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        return [f"train.global_batch_size={t.global_batch_size} is not divisible by "
                f"train.micro_batch_size={t.micro_batch_size} × parallel.dp={p.dp} = "
                f"{per_step}: use a multiple such as {lo}"]
    m = c.grad_accum
    if p.microbatches is not None and p.microbatches != m:
        return [f"parallel.microbatches={p.microbatches} but train.global_batch_size / "
                f"(micro_batch_size × dp) = {m}: leave parallel.microbatches unset or match it"]
    if p.pp > 1 and p.schedule in ONE_F_ONE_B_FAMILY and m < p.pp:
        return [f"parallel.schedule={p.schedule} needs microbatches ({m}) ≥ parallel.pp="
                f"{p.pp}: raise train.global_batch_size or lower train.micro_batch_size"]
    return []


def batch_refused(c: Config) -> bool:
    """`check_batch` refuses this batch split (its fix names the batch keys): no schedule to
    build."""
    p, per_step = c.parallel, c.train.micro_batch_size * c.parallel.dp
    return (c.train.global_batch_size % per_step != 0 or c.grad_accum < 1
            or (p.schedule in ONE_F_ONE_B_FAMILY and c.grad_accum < p.pp))

"""The `simulate` group (task=simulate): the costs of one stage-microbatch, and the schedule the
configured pipeline keys build."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpctrain.config.build import build
from hpctrain.config.rule import check, errors_of
from hpctrain.config.schema import Config
from hpctrain.parallel.pipeline.actions import Schedule
from hpctrain.parallel.pipeline.schedules import build_schedule


@dataclass(frozen=True)
class SimulateConfig:
    """The `simulate` group (task=simulate): costs of one stage-microbatch, any time unit."""

    t_f: float = 1.0  # forward
    t_b: float = 1.0  # input gradient (B)
    t_w: float = 1.0  # weight gradient (W); a fused BW costs t_b + t_w
    t_comm: float = 0.0  # one point-to-point hop


def simulate_costs(cfg: Config) -> dict[str, float]:
    """The `simulate` group (from Config.extra) checked: known keys, non-negative numbers,
    t_f + t_b + t_w > 0. Raises ValueError naming the key and the fix."""
    costs = dataclasses.asdict(build(SimulateConfig, "simulate", cfg.extra.get("simulate") or {}))
    for key, value in costs.items():
        if value < 0:
            raise ValueError(f"simulate.{key}={value!r} must be a number >= 0")
    if costs["t_f"] + costs["t_b"] + costs["t_w"] <= 0:
        raise ValueError("simulate.t_f + simulate.t_b + simulate.t_w must be > 0: give the "
                         "compute costs of one stage-microbatch")
    return {k: float(v) for k, v in costs.items()}


def simulated_schedule(cfg: Config) -> Schedule:
    """The configured schedule (ValueError from build_schedule on a bad combination)."""
    p = cfg.parallel
    microbatches = p.microbatches if p.microbatches is not None else cfg.grad_accum
    return build_schedule(p.schedule, pp=p.pp, microbatches=microbatches,
                          virtual_stages=p.virtual_stages)


@check("train.global_batch_size", "train.micro_batch_size", "parallel.")
def check_simulate(c: Config) -> list[str]:
    """task=simulate: the schedule and the simulate.* costs."""
    return errors_of(c, simulated_schedule, simulate_costs)

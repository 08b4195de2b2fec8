"""task=simulate: simulate the configured pipeline schedule once (no ranks) and report it.

Reads parallel.pp, parallel.schedule, parallel.virtual_stages and parallel.microbatches (when
unset: train.global_batch_size / (micro_batch_size × dp)), and the costs simulate.t_f, t_b, t_w,
t_comm (defaults 1, 1, 1, 0). Writes `simulation.json` (the `simulation_report` plus the
schedule as CSV) and `timeline.png` into the run directory and logs a short table.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.config import Config
from hpctrain.config_build import build
from hpctrain.parallel.pipeline.actions import Schedule
from hpctrain.parallel.pipeline.report import format_table, simulation_report
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.simulate import simulate
from hpctrain.parallel.pipeline.timeline import draw_timeline

log = logging.getLogger(__name__)


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


def run_simulate(cfg: Config) -> dict[str, Any]:
    schedule, costs = simulated_schedule(cfg), simulate_costs(cfg)
    result = simulate(schedule, **costs)
    report = simulation_report(schedule, result, costs=costs)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    png = draw_timeline(result.boxes(), run_dir / "timeline.png",
                        title=f"{schedule.name}: pp={schedule.n_ranks}, "
                              f"m={schedule.n_microbatches}, bubble {result.bubble_rate:.3f}")
    out = {**report, "timeline_png": str(png), "schedule_csv": schedule.to_csv()}
    (run_dir / "simulation.json").write_text(json.dumps(out, indent=2))
    # The table is the task's result: the CLI prints it on stdout (hpctrain.cli.format_result).
    return {**out, "json": str(run_dir / "simulation.json"), "text": format_table(report)}

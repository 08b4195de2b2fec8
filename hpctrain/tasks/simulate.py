"""task=simulate: simulate the configured pipeline schedule once (no ranks) and report it.

Reads parallel.pp, parallel.schedule, parallel.virtual_stages and parallel.microbatches (when
unset: train.global_batch_size / (micro_batch_size × dp)), and the costs simulate.t_f, t_b, t_w,
t_comm (defaults 1, 1, 1, 0). Writes `simulation.json` (the `simulation_report` plus the
schedule as CSV) and `timeline.png` into the run directory and logs a short table.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hpctrain.config.schema import Config
from hpctrain.config.simulate import simulate_costs, simulated_schedule
from hpctrain.parallel.pipeline.report import format_table, simulation_report
from hpctrain.parallel.pipeline.simulate import simulate
from hpctrain.parallel.pipeline.timeline import draw_timeline

log = logging.getLogger(__name__)


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
    # The table is the task's result: the CLI prints it on stdout (hpctrain.tasks.TASKS).
    return {**out, "json": str(run_dir / "simulation.json"), "text": format_table(report)}

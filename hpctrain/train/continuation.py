"""Running a run directory again: what a finished run says, and what a longer run changes.

A run directory whose checkpoint is at train.steps is complete: running it again trains
nothing and rewrites nothing (its summary.json keeps its numbers); the run says so and how to
continue. Raising train.steps continues it, and since the LR is a pure function of the step and
of train.steps (hpctrain.train.optim), the schedule from the checkpoint's step on changes: one
line says from what to what.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hpctrain.config.schema import OptimConfig
from hpctrain.distributed import restarts
from hpctrain.train.optim import lr_at

log = logging.getLogger(__name__)

TOTAL_FREE = ("constant", "inv_sqrt")  # schedules that do not read train.steps


def complete_message(run_dir: Path, *, step: int, steps: int) -> str:
    """What a re-run of a run already at `step` ≥ train.steps=`steps` says (nothing trained)."""
    more = max(2 * step, step + 1)
    return (f"run {run_dir} is complete at step {step} (train.steps={steps}): nothing to "
            f"train, its outputs are kept; to continue it, raise train.steps, e.g. "
            f"train.steps={more}, or train a new run in another directory "
            f"(hydra.run.dir=...)")


def stopped_early_message(*, step: int, steps: int) -> str:
    """What a run stopped by train.stop_after says (a checkpoint at `step` follows)."""
    return (f"stopped early after step {step} of train.steps={steps} (train.stop_after="
            f"{step}): the checkpoint at step {step} is saved; run the same command without "
            f"train.stop_after (same run directory) to continue to step {steps}")


def kept_summary(run_dir: Path) -> dict[str, Any]:
    """The finished run's summary.json as it is ({} when it has none)."""
    path = run_dir / "summary.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def schedule_change(optim: OptimConfig, *, step: int, saved_steps: int | None,
                    steps: int) -> str | None:
    """One line saying how the LR schedule changes when a run saved with train.steps =
    `saved_steps` continues at `step` with train.steps = `steps`; None when nothing changes
    (same total, a schedule that does not depend on it, or a checkpoint that did not record
    its total)."""
    if saved_steps is None or saved_steps == steps or optim.lr_schedule in TOTAL_FREE:
        return None
    old = lr_at(step, optim, total_steps=saved_steps)
    new = lr_at(step, optim, total_steps=steps)
    return (f"train.steps changed from {saved_steps} to {steps} since the checkpoint at step "
            f"{step}: the {optim.lr_schedule} LR schedule now runs to step {steps}, so the LR "
            f"of step {step + 1} is {new:.4g} instead of {old:.4g}, reaching {optim.min_lr:.4g} "
            f"at step {steps}")


def record_restart(run_dir: Path, *, step: int, world: int, layout: str, loggers) -> None:
    """After a fault's requeue (hpctrain.launch.requeue): complete its restart record with the
    step resumed and this start's world, and log it (restarts.jsonl, metrics, W&B)."""
    record = restarts.complete(run_dir, resumed_step=step, world=world, layout=layout)
    if record is None:
        return
    count = len(restarts.history(run_dir))
    log.warning("restart %d after %s (excluded %s): resumed at step %d, %s steps lost, world "
                "%d -> %d, layout %s -> %s", count, record["cause"],
                ",".join(record["nodes"]) or "no node", step, record["steps_lost"],
                record["world_before"], record["world_after"], record["layout_before"],
                record["layout_after"])
    loggers.log(step, {"restarts": count, "restart_steps_lost": record["steps_lost"],
                       "restart_world": record["world_after"], "restart_cause": record["cause"]})

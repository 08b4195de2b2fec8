"""plan.calibrate_from=<run dir>: refine the device constants from a finished training run.

A training run logs, once, what the planner predicted for it (predicted_step_time_s, its
compute part predicted_compute_s, the peak FLOP/s it assumed and its device name) and then its
measured step times (metrics.jsonl, `hpctrain.plan.predict`). The compute part is the one
constant a run can refine: the measured step time less the predicted non-compute part
(communication, bubble) is the measured compute time, so

  achievable_fraction' = achievable_fraction · predicted_compute / (measured − predicted other)

with `measured` the median step time after the first (warm-up) step. The run's own
achievable_fraction is read from its .hydra/config.yaml when there (else the current one).
When the plan has no accelerator row (a CPU run), the run's measured device (its name and
peak) becomes the plan's device. Links are not refined here: a task=bench bench.json does
that (cluster.calibration).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpctrain.metrics.devices import DeviceSpec
from hpctrain.plan.calibrate import measured_spec
from hpctrain.plan.cluster import ClusterSpec

KEYS = ("predicted_step_time_s", "predicted_compute_s", "predicted_peak_flops")


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """The prediction and the median measured step time (after step 1) of a finished run."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"plan.calibrate_from={str(run_dir)!r}: no metrics.jsonl there; pass "
                         "the run directory of a finished training run")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    predicted = next((r for r in records if all(k in r for k in KEYS)), None)
    steps = [r["step_time_s"] for r in records if "step_time_s" in r and r.get("step", 0) > 1]
    if predicted is None or not steps:
        raise ValueError(f"{path} has no predicted_* record or no step after the first: "
                         "calibrate from a run of 2 or more steps made by this version")
    return {"measured_step_time_s": statistics.median(steps), "steps": len(steps),
            "device": predicted.get("predicted_device"),
            **{k: predicted[k] for k in KEYS}, "fraction": _run_fraction(Path(run_dir))}


def _run_fraction(run_dir: Path) -> float | None:
    cfg = run_dir / ".hydra" / "config.yaml"
    if not cfg.is_file():
        return None
    from omegaconf import OmegaConf  # the run dir's Hydra record, read only here

    return OmegaConf.load(cfg).get("cluster", {}).get("achievable_fraction")


def run_device(run: dict[str, Any], *, precision: str) -> DeviceSpec:
    """The run's measured device: its name and GEMM throughput in `precision`."""
    return measured_spec(str(run["device"]), {precision: run["predicted_peak_flops"]})


def refine(cluster: ClusterSpec, run: dict[str, Any]) -> tuple[ClusterSpec, dict[str, Any]]:
    """`cluster` with achievable_fraction from `run` (module docstring); the second value
    records before/after for plan.json."""
    base = run["fraction"] or cluster.achievable_fraction
    other = run["predicted_step_time_s"] - run["predicted_compute_s"]
    compute = run["measured_step_time_s"] - other
    if compute <= 0:
        raise ValueError(f"the run measured {run['measured_step_time_s']:.4g} s per step, less "
                         f"than the predicted communication and bubble ({other:.4g} s): the "
                         "link constants are off; calibrate them with cluster.calibration")
    fraction = min(1.0, base * run["predicted_compute_s"] / compute)
    out = replace(cluster, achievable_fraction=fraction)
    return out, {"achievable_fraction_before": base, "achievable_fraction": fraction,
                 "measured_step_time_s": run["measured_step_time_s"],
                 "predicted_step_time_s": run["predicted_step_time_s"]}

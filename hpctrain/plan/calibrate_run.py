"""plan.calibrate_from=<run dir>: refine the constants of the device a training run used.

A training run logs, once, what the planner predicted for it (predicted_step_time_s, its
compute part predicted_compute_s, the peak FLOP/s it assumed, its device and its layout) and
then its measured step times (metrics.jsonl, `hpctrain.plan.predict`); `measured` below is the
median step time after the first (warm-up) step. What a run refines is the device's in-step
kernel rate: achievable_fraction, the GEMM share of the peak, with the fused-attention rates
that scale with it (`hpctrain.plan.kernels.roofline`: shares × achievable_fraction / mamf).
HBM-bound kernels and links are not refined here (a task=bench bench.json does the links:
cluster.calibration).

  exact         when the plan is the run's layout (same `layout` string) and the caller
                passes the plan's step-time function: the GEMM shapes a GPU run timed
                (measured_gemm_flops, `calibrate.measure_gemm_shapes`) replace the roofline
                for those shapes (ClusterSpec.gemm_flops: measured rate · gemm/mamf), then the
                achievable_fraction at which the current model predicts the measured step
                time (bisection; the step time falls as the fraction grows), capped at 1
  proportional  otherwise, from the logged values: the measured step time less the predicted
                non-compute part (communication, bubble) is the measured compute time, so
                achievable_fraction' = achievable_fraction · predicted_compute / (measured −
                predicted other)

The run's own achievable_fraction is read from its .hydra/config.yaml when there (else the
plan's). The refined constants belong to the run's device: a plan for another device
generation is refused (an A100 run says nothing about an H100). The record for plan.json
holds both fractions and the error of the prediction against the measured step time before
and after (`error_before`, `error_after`: predicted / measured − 1). When the plan has no
accelerator row (a CPU run), the run's measured device (its name and peak) becomes the plan's.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpctrain.metrics.devices import DeviceSpec, lookup_device
from hpctrain.plan.calibrate import measured_spec
from hpctrain.plan.cluster import ClusterSpec

KEYS = ("predicted_step_time_s", "predicted_compute_s", "predicted_peak_flops")
SOLVE_LOW = 1e-3  # the smallest achievable_fraction the exact method tries
SOLVE_STEPS = 40  # bisection steps: the fraction to ~1e-12


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
    gemms = tuple(tuple(row) for row in predicted.get("measured_gemm_flops", ()))
    return {"measured_step_time_s": statistics.median(steps), "steps": len(steps),
            "device": predicted.get("predicted_device"), "layout": predicted.get("layout"),
            "gemm_flops": gemms,
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


def refine(cluster: ClusterSpec, run: dict[str, Any], *,
           step_time_of: Callable[[ClusterSpec], float] | None = None,
           plan_layout: str | None = None) -> tuple[ClusterSpec, dict[str, Any]]:
    """`cluster` with the achievable_fraction `run` measured (module docstring); the second
    value records before/after for plan.json. step_time_of: the plan's predicted step time on
    a cluster, and plan_layout its layout as the run logs it ("dp1 tp1 … none"), for the
    exact method; without them, or for another layout, the proportional one."""
    _check_device(cluster, run)
    base = run["fraction"] or cluster.achievable_fraction
    measured = run["measured_step_time_s"]
    exact = step_time_of is not None and plan_layout is not None \
        and run.get("layout") == plan_layout
    if exact:
        before = step_time_of(replace(cluster, achievable_fraction=base))
        cluster = replace(cluster, gemm_flops=run.get("gemm_flops", ()))  # the run's kernels
        fraction = _solve(step_time_of, cluster, measured)
        after = step_time_of(replace(cluster, achievable_fraction=fraction))
    else:
        before = run["predicted_step_time_s"]
        fraction, after = _proportional(run, base)
    out = replace(cluster, achievable_fraction=fraction)
    return out, {"device": cluster.device.name, "method": "exact" if exact else "proportional",
                 "measured_gemm_shapes": len(out.gemm_flops),
                 "achievable_fraction_before": base, "achievable_fraction": fraction,
                 "measured_step_time_s": measured, "predicted_step_time_s": before,
                 "predicted_step_time_after_s": after,
                 "error_before": before / measured - 1, "error_after": after / measured - 1}


def _proportional(run: dict[str, Any], base: float) -> tuple[float, float]:
    """(fraction, predicted step time after) of the proportional method."""
    other = run["predicted_step_time_s"] - run["predicted_compute_s"]
    compute = run["measured_step_time_s"] - other
    if compute <= 0:
        raise ValueError(f"the run measured {run['measured_step_time_s']:.4g} s per step, less "
                         f"than the predicted communication and bubble ({other:.4g} s): the "
                         "link constants are off; calibrate them with cluster.calibration")
    fraction = min(1.0, base * run["predicted_compute_s"] / compute)
    return fraction, other + run["predicted_compute_s"] * base / fraction


def _solve(step_time_of, cluster: ClusterSpec, measured: float) -> float:
    """The fraction in (0, 1] whose predicted step time is `measured` (1 if even that is
    slower); ValueError when the model is slower than measured at any fraction."""
    def at(f: float) -> float:
        return step_time_of(replace(cluster, achievable_fraction=f))

    lo, hi = SOLVE_LOW, 1.0
    if at(hi) >= measured:
        return hi
    if at(lo) < measured:
        raise ValueError(f"the run measured {measured:.4g} s per step, more than the model "
                         f"predicts at achievable_fraction={lo} ({at(lo):.4g} s): is "
                         "plan.calibrate_from the run of this config?")
    for _ in range(SOLVE_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) > measured else (lo, mid)
    return (lo + hi) / 2


def _check_device(cluster: ClusterSpec, run: dict[str, Any]) -> None:
    """ValueError when the run's device is not the plan's (by device-table row)."""
    ran, plan = _row(str(run.get("device"))), _row(cluster.device.name)
    if ran != plan:
        raise ValueError(f"plan.calibrate_from: the run used {run.get('device')!r}, the plan is "
                         f"for {cluster.device.name!r}; a run refines its own device's "
                         "constants: plan for that device (cluster.accelerator) or calibrate "
                         "from a run on this one")


def _row(name: str) -> str:
    """The device-table row a device name resolves to, else the name without its suffix."""
    bare = name.split(" (")[0]
    found = lookup_device(bare)
    return found.name if found is not None else bare

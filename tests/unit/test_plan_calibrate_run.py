"""plan.calibrate_from refines the run's own device: exactly by the plan's step time when the
plan is the run's layout, proportionally otherwise; before/after errors; other devices refused."""

from __future__ import annotations

import json

import pytest

from hpctrain.bench.gemm import model_shapes
from hpctrain.models.config import PRESETS
from hpctrain.plan.calibrate_run import read_run, refine
from hpctrain.plan.cluster import dgx_h100_cluster
from hpctrain.plan.kernels import roofline
from hpctrain.tasks.plan import run_plan
from tests.conftest import make_config
from tests.unit.test_plan_task import LLAMA8B

LAYOUT = "dp8 tp1 pp1 v1 z1 1f1b selective"  # LLAMA8B's, as predict_run logs it


def _run_dir(tmp_path, *, measured: float, device: str = "H100-SXM", layout: str = LAYOUT,
             gemms: list | None = None):
    """A finished run's metrics.jsonl: the logged prediction, then four steps."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    records = [{"predicted_step_time_s": 2.0, "predicted_compute_s": 1.5,
                "predicted_peak_flops": 989e12, "predicted_device": device, "layout": layout}]
    if gemms is not None:
        records[0]["measured_gemm_flops"] = gemms
    records += [{"step": i, "step_time_s": measured + (i == 1)} for i in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_exact_calibration_meets_the_measured_step_and_reports_both_errors(tmp_path):
    plain = run_plan(make_config(LLAMA8B, run_dir=tmp_path / "plain"))
    measured = 1.3 * plain["step_time_s"]  # the run was 30% slower than predicted
    run = _run_dir(tmp_path, measured=measured)
    plan = run_plan(make_config([*LLAMA8B, f"plan.calibrate_from={run}"],
                                run_dir=tmp_path / "plan"))
    cal = plan["calibration"]
    assert cal["method"] == "exact" and cal["device"] == "H100-SXM"
    assert cal["measured_step_time_s"] == pytest.approx(measured)
    assert cal["error_before"] == pytest.approx(plain["step_time_s"] / measured - 1)
    assert abs(cal["error_after"]) < 1e-9
    assert plan["step_time_s"] == pytest.approx(measured, rel=1e-9)
    assert cal["achievable_fraction"] < cal["achievable_fraction_before"] == 0.5


def test_a_gpu_runs_measured_gemms_replace_the_roofline_for_its_shapes(tmp_path):
    """The run logged its GEMM shapes (calibrate.measure_gemm_shapes on a GPU): the plan of
    the same layout times those at rate · gemm/mamf, then solves the fraction; the result
    still meets the measured step, and differs from the roofline-only calibration."""
    plain = run_plan(make_config(LLAMA8B, run_dir=tmp_path / "plain"))
    measured = 1.3 * plain["step_time_s"]
    shapes = sorted({s[2:] for s in model_shapes(PRESETS["llama3_8b"], tokens=4096, tp=1)})
    gemms = [["bf16", m, k, n, 400e12] for m, k, n in shapes]  # slow GEMMs, fast the rest
    runs = {name: _run_dir(tmp_path / name, measured=measured, gemms=g)
            for name, g in (("kernels", gemms), ("roofline", None))}
    cals = {name: run_plan(make_config([*LLAMA8B, f"plan.calibrate_from={run}"],
                                       run_dir=tmp_path / f"plan_{name}"))
            for name, run in runs.items()}
    assert cals["kernels"]["calibration"]["measured_gemm_shapes"] == len(shapes) == 5
    assert cals["roofline"]["calibration"]["measured_gemm_shapes"] == 0
    for plan in cals.values():
        assert plan["step_time_s"] == pytest.approx(measured, rel=1e-9)
    assert cals["kernels"]["calibration"]["achievable_fraction"] != pytest.approx(
        cals["roofline"]["calibration"]["achievable_fraction"])


def test_another_layout_is_calibrated_proportionally(tmp_path):
    run = read_run(_run_dir(tmp_path, measured=2.5, layout="dp4 tp2 pp1 v1 z1 1f1b none"))
    cluster = dgx_h100_cluster()
    refined, cal = refine(cluster, run, step_time_of=lambda c: 99.0, plan_layout=LAYOUT)
    # other = 2.0 − 1.5 = 0.5 s, so the compute measured 2.0 s against 1.5 predicted
    assert cal["method"] == "proportional"
    assert refined.achievable_fraction == pytest.approx(0.5 * 1.5 / 2.0)
    assert (cal["error_before"], cal["error_after"]) == pytest.approx((2.0 / 2.5 - 1, 0.0))
    # the fused-attention rates of the device follow its refined in-step share
    r0, r1 = (roofline(c.device, precision="bf16", achievable_fraction=c.achievable_fraction)
              for c in (cluster, refined))
    assert r1.attn_fwd / r0.attn_fwd == pytest.approx(1.5 / 2.0)


def test_a_run_on_another_device_is_refused(tmp_path):
    run = _run_dir(tmp_path, measured=2.5, device="A100-80GB")
    with pytest.raises(ValueError, match="the run used 'A100-80GB', the plan is for 'H100-SXM'"):
        run_plan(make_config([*LLAMA8B, f"plan.calibrate_from={run}"], run_dir=tmp_path))
    torch_name = read_run(_run_dir(tmp_path / "b", measured=2.5,
                                   device="NVIDIA H100 80GB HBM3"))
    refine(dgx_h100_cluster(), torch_name)  # torch's name of the same device: accepted

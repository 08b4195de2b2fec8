"""plan_report JSON and the text tables."""

import json

import pytest

from hpctrain.models.config import PRESETS
from hpctrain.plan.cluster import megatron_a100_cluster
from hpctrain.plan.layout import Layout
from hpctrain.plan.report import format_plan_table, format_search_table, plan_report
from hpctrain.plan.search import search_layouts


def _report(**kw):
    args = dict(layout=Layout(dp=2, tp=2, pp=2, zero=1, sp=True), global_batch=16,
                micro_batch_size=1, seq_len=2048, recompute="selective")
    args.update(kw)
    return plan_report(PRESETS["medium"], megatron_a100_cluster(), **args)


def test_report_is_json_and_consistent():
    rep = json.loads(json.dumps(_report()))
    mem = rep["memory_bytes"]
    parts = sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "buffers"))
    assert mem["total"] == pytest.approx(parts)
    assert rep["fits"] is (mem["total"] <= rep["device_memory_bytes"])
    assert rep["inputs"]["in_flight"] == 2  # 1f1b first stage: min(m=8, pp=2)
    assert rep["step_time_s"] == rep["time"]["step_time_s"] > 0
    assert 0 < rep["mfu"] < 1


def test_report_in_flight_override_changes_activations():
    small = _report(in_flight=1)["memory_bytes"]["activations"]
    big = _report(in_flight=4)["memory_bytes"]["activations"]
    assert big == pytest.approx(4 * small)


def test_plan_table_lists_memory_and_rates():
    text = format_plan_table(_report())
    for key in ("mem optimizer", "fits", "bubble", "tokens/s", "MFU", "dp2 tp2 pp2"):
        assert key in text


def test_search_table_top_rows():
    out = search_layouts(PRESETS["small"], megatron_a100_cluster(), n_devices=8,
                         global_batch=64, micro_batch_size=4, seq_len=512)
    text = format_search_table(out, top=3)
    lines = text.splitlines()
    assert lines[0].startswith("#") and "reason" in lines[0]
    assert "best" in lines[1] and len(lines) == 5
    assert lines[-1].startswith(f"... {len(out) - 3} more: every candidate is in plan.json")


def test_task_plan_fits_against_the_memory_less_the_headroom(tmp_path):
    """task=plan judges fits against the limit less plan.headroom, as parallel=auto and the
    pre-launch check do (it used to read "yes" up to the whole device): a layout at 95% of the
    usable memory fits, one at 105% (still under the limit itself) does not."""
    from hpctrain.tasks.plan import run_plan
    from tests.conftest import make_config

    base = ["task=plan", "model=debug", "train=debug", "cluster.accelerator=H100-SXM"]
    need = run_plan(make_config(base, run_dir=tmp_path))["memory_bytes"]["total"]
    for share, fits in ((0.95, True), (1.05, False)):
        limit_gb = need / share / 0.9 / 2**30  # usable = 0.9 × limit = need / share
        report = run_plan(make_config([*base, f"plan.memory_limit_gb={limit_gb}"],
                                             run_dir=tmp_path))
        assert need < limit_gb * 2**30 and report["fits"] is fits, share
        assert f"fits             {'yes' if fits else 'NO'} (" in report["text"]
        assert "GiB usable; device " in report["text"]

"""task=plan from the command line: plan.json with memory, fit, time; search; clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, make_config

LLAMA8B = ["task=plan", "model=llama3_8b", "cluster.accelerator=H100-SXM",
           "cluster.procs_per_node=8", "parallel.dp=8", "parallel.zero=1",
           "train.precision=bf16", "train.seq_len=4096", "train.global_batch_size=64",
           "train.micro_batch_size=1", "train.activation_checkpointing=selective"]


def test_plan_cli_writes_plan_json(tmp_path):
    cmd = [sys.executable, "-m", "hpctrain", *LLAMA8B, "plan.search=true", "plan.top=3",
           f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    mem = plan["memory_bytes"]
    assert mem["total"] == pytest.approx(sum(mem[k] for k in (
        "params", "grads", "optimizer", "activations", "buffers")))
    psi = 8_030_261_248  # Llama-3 8B parameters
    assert mem["params"] == 2 * psi and mem["optimizer"] == pytest.approx(12 * psi / 8)
    assert plan["fits"] is True and plan["step_time_s"] > 0 and 0 < plan["mfu"] < 1
    assert plan["search"][0]["reason"] == "best"
    assert "best layouts for 8 devices" in proc.stdout and "more: every candidate is in "\
        "plan.json" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"outputs: {tmp_path / 'plan.json'}")


@pytest.mark.parametrize("overrides,message", [
    (["cluster.accelerator=null"], "task=plan needs cluster.accelerator"),
    (["cluster.accelerator=TPUv9"], "cluster.accelerator='TPUv9' is not in the device table"),
    (["+plan.serch=true"], "Did you mean plan.search"),
    (["parallel.dp=4"], "set parallel.dp=8"),
])
def test_plan_mistakes_are_clear(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_config([*LLAMA8B, *overrides], run_dir=tmp_path)


def test_pipeline_in_flight_comes_from_the_simulator(tmp_path):
    from hpctrain.plan.inputs import simulated_in_flight

    cfg = make_config([*LLAMA8B, "parallel.dp=2", "parallel.pp=4", "parallel.schedule=zb_h2"],
                      run_dir=tmp_path)
    assert simulated_in_flight(cfg) == 2 * 4 - 1  # ZB-H2 keeps 2p-1 on the first stage

"""task=simulate end to end: `python -m hpctrain task=simulate ...` writes JSON and PNG."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from hpctrain.config.simulate import simulate_costs
from tests.conftest import ROOT, make_config


def test_simulate_cli_writes_json_and_png(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpctrain", "task=simulate", "parallel.pp=4",
           "parallel.microbatches=8", "parallel.schedule=zb_h1", "simulate.t_w=0.5",
           f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "simulation.json").read_text())
    assert report["schedule"] == "zb_h1" and report["pp"] == 4 and report["microbatches"] == 8
    assert report["costs"] == {"t_f": 1.0, "t_b": 1.0, "t_w": 0.5, "t_comm": 0.0}
    # ZB-H1 bubble (p-1)(T_F+T_B-T_W) over cost m(T_F+T_B+T_W) + bubble.
    bubble = 3 * (1 + 1 - 0.5)
    assert report["bubble_rate"] == pytest.approx(bubble / (8 * 2.5 + bubble))
    assert report["peak_activations"] == [4, 3, 2, 1]
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert "bubble rate" in proc.stdout and "bubble rate" not in proc.stderr  # a result
    assert proc.stdout.rstrip().endswith(f"outputs: {out / 'simulation.json'}, "
                                         f"{out / 'timeline.png'}")


def test_simulate_needs_no_world_and_checks_schedule(tmp_path):
    cfg = make_config(["task=simulate", "parallel.pp=4", "parallel.microbatches=8"],
                      run_dir=tmp_path)  # world of 1 process, pp=4: fine, nothing is launched
    assert cfg.task == "simulate" and cfg.extra["simulate"]["t_f"] == 1.0
    with pytest.raises(ValueError, match="microbatches >= pp"):
        make_config(["task=simulate", "parallel.pp=4", "parallel.microbatches=2"],
                    run_dir=tmp_path)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        make_config(["task=simulate", "parallel.pp=2", "parallel.microbatches=4",
                     "parallel.schedule=interleaved_1f1b"], run_dir=tmp_path)


def test_simulate_keys_are_validated(tmp_path):
    cfg = make_config(["task=simulate", "parallel.pp=2", "parallel.microbatches=4"],
                      run_dir=tmp_path)
    with pytest.raises(ValueError, match="Did you mean simulate.t_f"):
        simulate_costs(replace(cfg, extra={"simulate": {"t_ff": 1}}))
    with pytest.raises(ValueError, match="simulate.t_b=-1"):
        simulate_costs(replace(cfg, extra={"simulate": {"t_b": -1}}))

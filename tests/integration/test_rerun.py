"""A finished run directory run again: nothing lost, and a longer run says how its LR changes."""

from __future__ import annotations

from hpctrain import dispatch
from hpctrain.config.schema import OptimConfig
from hpctrain.metrics.logger import read_jsonl
from hpctrain.train.continuation import schedule_change
from tests.conftest import make_config

SMALL = ["model=debug", "train=debug", "data.max_bytes=300000", "logger.wandb=disabled",
         "logger.progress=plain", "train.eval_every=3", "optim.warmup_steps=1"]


def test_rerun_keeps_summary_and_longer_run_states_schedule(tmp_path, capfd):
    run_dir = tmp_path / "run"
    dispatch.run(make_config([*SMALL, "train.steps=3", "train.stop_after=2"], run_dir=run_dir))
    assert "stopped early after step 2 of train.steps=3" in capfd.readouterr().err
    first = dispatch.run(make_config([*SMALL, "train.steps=3"], run_dir=run_dir))
    before = (run_dir / "summary.json").read_text()
    assert first["final_eval_loss"] is not None
    capfd.readouterr()
    again = dispatch.run(make_config([*SMALL, "train.steps=3"], run_dir=run_dir))
    err = capfd.readouterr().err
    assert (run_dir / "summary.json").read_text() == before
    assert again["final_loss"] == first["final_loss"]
    assert "is complete at step 3" in err and "train.steps=6" in err
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 3
    longer = dispatch.run(make_config([*SMALL, "train.steps=5"], run_dir=run_dir))
    assert longer["completed_steps"] == 5
    assert "train.steps changed from 3 to 5" in capfd.readouterr().err


def test_schedule_change_line():
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=0)
    line = schedule_change(optim, step=10, saved_steps=10, steps=20)
    assert "from 10 to 20" in line and "0.0001" in line and "0.00055" in line
    assert schedule_change(optim, step=10, saved_steps=20, steps=20) is None
    assert schedule_change(optim, step=10, saved_steps=None, steps=20) is None
    const = OptimConfig(lr_schedule="constant", warmup_steps=0)
    assert schedule_change(const, step=10, saved_steps=10, steps=20) is None

"""train.compile=blocks through the real Trainer on packed documents: tp=2 with sequence
parallelism, pp=2 (with full activation checkpointing) and cp=2 follow the eager single-process
loss trajectory (fp32), compile no graph after the second step, and report compile time.

Under tp the collectives are graph breaks (hpctrain.parallel.tensor.comm), so a block is a few
graphs, each traced once."""

from __future__ import annotations

import pytest

from tests.conftest import get_world
from tests.parallel.trainer_runs import assert_trajectory_close, logged_trajectory, run_trainer

STEPS = 4


def _compiled_run(overrides: list[str], run_dir: str):
    trainer = run_trainer(["train.compile=blocks", *overrides], run_dir, steps=STEPS)
    return ([(h["loss"], h["grad_norm"]) for h in trainer.history],
            trainer.compile_watch.summary())


def _eager_run(run_dir: str):
    trainer = run_trainer([], run_dir, steps=STEPS)
    return [(h["loss"], h["grad_norm"]) for h in trainer.history]


@pytest.fixture(scope="module")
def eager_trajectory(tmp_path_factory):
    return get_world(1).run(_eager_run, str(tmp_path_factory.mktemp("eager")))[0]


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.sp=true"],
    ["parallel.pp=2", "train.activation_checkpointing=full"],
    ["parallel.cp=2"],  # dynamo breaks the graph at ring attention's exchanges
], ids=["tp2_sp", "pp2_full_ac", "cp2"])
def test_compiled_blocks_follow_eager(world2, tmp_path, eager_trajectory, layout):
    runs = world2.run(_compiled_run, layout, str(tmp_path))
    got = logged_trajectory([trajectory for trajectory, _ in runs])
    assert_trajectory_close(got, eager_trajectory)
    for _, stats in runs:
        assert stats["compiled_graphs"] >= 1 and stats["compile_s"] > 0, stats
        assert 1 <= stats["compiled_graphs_train_step"] <= stats["compiled_graphs"], stats
        assert stats["recompiles_after_warmup"] == 0, stats

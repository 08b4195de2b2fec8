"""Checkpoints are layout-independent: full tensors under full-model names. A run saved at
tp=2 resumes at tp=1 and tp=4, one saved at pp=2 resumes at pp=1, and both continue the
uninterrupted tp=1 trajectory (fp32 tolerance); resuming at the same tp=2 layout is bit-identical
to never stopping."""

from __future__ import annotations

import pytest

from hpctrain.checkpoint import save_load as ckpt
from tests.conftest import ROOT, get_world
from tests.parallel.trainer_runs import assert_trajectory_close, logged_trajectory, train_in_world

STOP = 2
# Written by hpctrain before checkpoints were sharded (6e67b45: full tensors, one chunk per
# key), by train_in_world at tp=2 with train.stop_after=2.
BEFORE_SHARDING = ROOT / "tests" / "golden" / "ckpt_before_sharding" / "step_00000002"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[float, float]]:
    run_dir = tmp_path_factory.mktemp("ref")
    return get_world(1).run(train_in_world, [], str(run_dir))[0]


def _saved(world, overrides, tmp_path) -> str:
    run_dir = tmp_path / "saved"
    world.run(train_in_world, [*overrides, f"train.stop_after={STOP}"], str(run_dir))
    path = ckpt.latest_complete(run_dir)
    assert path is not None and path.name.endswith(f"{STOP:08d}")
    return str(path)


def test_tp2_checkpoint_resumes_at_tp1_tp2_tp4(world2, world4, tmp_path, reference):
    path = _saved(world2, ["parallel.tp=2"], tmp_path)
    resume = f"train.resume={path}"
    tp1 = get_world(1).run(train_in_world, [resume], str(tmp_path / "tp1"))[0]
    assert_trajectory_close(tp1, reference[STOP:])
    tp4 = world4.run(train_in_world, ["parallel.tp=4", resume], str(tmp_path / "tp4"))
    assert_trajectory_close(logged_trajectory(tp4), reference[STOP:])
    tp2 = world2.run(train_in_world, ["parallel.tp=2", resume], str(tmp_path / "tp2"))
    straight = world2.run(train_in_world, ["parallel.tp=2"], str(tmp_path / "tp2_straight"))
    assert tp2[0] == straight[0][STOP:]  # same layout: bit-identical


def test_pp2_checkpoint_resumes_at_pp1(world2, tmp_path, reference):
    path = _saved(world2, ["parallel=pp2", "parallel.schedule=1f1b"], tmp_path)
    pp1 = get_world(1).run(train_in_world, [f"train.resume={path}"], str(tmp_path / "pp1"))[0]
    assert_trajectory_close(pp1, reference[STOP:])


def test_checkpoint_written_before_sharding_resumes_at_tp2_and_dp2_zero3(world2, tmp_path,
                                                                          reference):
    resume = f"train.resume={BEFORE_SHARDING}"
    tp2 = world2.run(train_in_world, ["parallel.tp=2", resume], str(tmp_path / "tp2"))
    assert_trajectory_close(tp2[0], reference[STOP:])
    dp2 = world2.run(train_in_world, ["parallel.dp=2", "parallel.zero=3", resume],
                     str(tmp_path / "dp2"))
    assert_trajectory_close(dp2[0], reference[STOP:])

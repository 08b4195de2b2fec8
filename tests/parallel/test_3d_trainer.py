"""Trainer with parallel=3d (dp=2 × tp=2 × pp=2, 8 ranks) follows the single-process loss
trajectory (fp32), with 1f1b and with zb_h1 + sequence parallelism; tp ranks agree exactly."""

from __future__ import annotations

import pytest

from tests.conftest import get_world
from tests.parallel.trainer_runs import logged_trajectory, train_in_world


@pytest.mark.parametrize("extra", [[], ["parallel.schedule=zb_h1", "parallel.sp=true"]])
def test_3d_trainer_matches_single_process(world8, tmp_path, extra):
    ref = get_world(1).run(train_in_world, [], str(tmp_path / "ref"))[0]
    runs = world8.run(train_in_world, ["parallel=3d", *extra], str(tmp_path / "3d"))
    got = logged_trajectory(runs)
    for (loss, norm), (loss1, norm1) in zip(got, ref, strict=True):
        assert loss == pytest.approx(loss1, rel=1e-5)
        assert norm == pytest.approx(norm1, rel=1e-4)
    # ranks 4..7 hold the last stage: dp replicas average the loss, tp ranks agree bit for bit,
    # and the loss is shared over each pp group, so ranks 0..3 report the same values
    assert all(r == runs[4] for r in runs[4:])
    assert all([loss for loss, _ in r] == [loss for loss, _ in runs[4]] for r in runs[:4])

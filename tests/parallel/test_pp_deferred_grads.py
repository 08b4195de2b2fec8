"""Zero-bubble schedules assign weight gradients in their W actions, outside autograd: the
data-parallel engine must still reduce them (zero 0/1 keep gradients in a bucket that autograd's
hooks normally adopt them into). pp=2 × dp=2 with zb_h1 follows the single process."""

from __future__ import annotations

import pytest

from tests.conftest import get_world
from tests.parallel.trainer_runs import train_in_world


@pytest.mark.parametrize("zero", [0, 1])
def test_zb_h1_with_dp_reduces_deferred_weight_grads(world4, tmp_path, zero):
    ref = get_world(1).run(train_in_world, [], str(tmp_path / "ref"))[0]
    runs = world4.run(train_in_world, ["parallel.pp=2", "parallel.dp=2", "cluster.procs_per_node=4",
                                       "parallel.schedule=zb_h1", f"parallel.zero={zero}"],
                      str(tmp_path / "pp"))
    for (loss, norm), (loss1, norm1) in zip(runs[-1], ref, strict=True):
        assert loss == pytest.approx(loss1, rel=1e-5)
        assert norm == pytest.approx(norm1, rel=1e-4)

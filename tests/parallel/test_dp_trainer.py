"""The trainer runs end to end on the data-parallel engine (dp=2, every ZeRO stage)."""

import math

import pytest

from tests.parallel import dp_helpers as h


@pytest.mark.parametrize("zero", [0, 3])
def test_trainer_runs_with_zero(world2, tmp_path, zero):
    overrides = ["model=debug", "train=debug", "train.steps=3", "train.eval_every=3",
                 "cluster.procs_per_node=2", "parallel.dp=2", f"parallel.zero={zero}",
                 "logger.wandb=disabled", "train.resume=never"]
    results = world2.run(h.run_trainer, overrides, str(tmp_path / f"z{zero}"), timeout_s=90)
    (losses0, mem0), (losses1, _) = results
    assert losses0 == losses1 and len(losses0) == 3 and all(map(math.isfinite, losses0))
    assert mem0["mem_optim_bytes"] > 0

"""The real Trainer at pp=2 in a shared world: every schedule reports the single process's loss
at each step and its eval loss (fp32 1e-5) on every rank — including zbv, whose last stage lives
on pipeline rank 0 — and activation checkpointing leaves the trajectory unchanged."""

from __future__ import annotations

import pytest

from tests.conftest import get_world
from tests.parallel.trainer_runs import run_trainer

EVAL = ["train.eval_every=2", "train.eval_samples=10"]  # 5 micro-batches > m=4: two chunks
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_h2", 1),
             ("zbv", 1)]


def reported(overrides: list[str], run_dir: str) -> list[tuple[float, float | None]]:
    """(loss, eval_loss or None) of every step, as this rank's trainer reports them."""
    trainer = run_trainer([*EVAL, *overrides], run_dir, steps=3)
    return [(h["loss"], h.get("eval_loss")) for h in trainer.history]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process reference run, once per mode of activation checkpointing."""
    cache = {}

    def run(*overrides: str):
        if overrides not in cache:
            run_dir = tmp_path_factory.mktemp("single")
            cache[overrides] = get_world(1).run(reported, list(overrides), str(run_dir))[0]
        return cache[overrides]

    return run


def _assert_same(runs, ref) -> None:
    for rank_run in runs:  # every rank of the pp group, not only the logging one
        assert len(rank_run) == len(ref)
        for (loss, ev), (loss1, ev1) in zip(rank_run, ref, strict=True):
            assert loss == pytest.approx(loss1, rel=1e-5)
            assert (ev is None) == (ev1 is None)
            if ev is not None:
                assert ev == pytest.approx(ev1, rel=1e-5)


@pytest.mark.parametrize("name,v", SCHEDULES)
def test_every_schedule_reports_the_single_process_loss(world2, single, tmp_path, name, v):
    runs = world2.run(reported, ["parallel=pp2", f"parallel.schedule={name}",
                                 f"parallel.virtual_stages={v}"], str(tmp_path))
    _assert_same(runs, single())


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_keeps_the_trajectory(world2, single, tmp_path, mode):
    ac = f"train.activation_checkpointing={mode}"
    runs = world2.run(reported, ["parallel=pp2", "parallel.schedule=zbv", ac], str(tmp_path))
    _assert_same(runs, single(ac))

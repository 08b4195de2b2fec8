"""eval_loss is a property of the run, not of its layout: the fixed train.eval_samples set,
split over dp, gives the single process's eval loss (fp32 rounding) at dp2, tp2, pp2 and cp2,
in one shared world of two ranks."""

from __future__ import annotations

import pytest

from hpctrain.train.eval_set import eval_indices
from tests.conftest import get_world
from tests.parallel.trainer_runs import run_trainer

EVAL = ["train.eval_every=2", "train.eval_samples=8", "train.seq_len=32"]
LAYOUTS = {"dp2": ["parallel.dp=2"], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"],
           "cp2": ["parallel.cp=2"]}


def eval_losses(overrides: list[str], run_dir: str) -> list[float]:
    trainer = run_trainer([*EVAL, *overrides], run_dir, steps=2)
    return [h["eval_loss"] for h in trainer.history if "eval_loss" in h]


def test_eval_loss_is_the_same_for_every_layout(world2, tmp_path):
    want = get_world(1).run(eval_losses, [], str(tmp_path / "single"))[0]
    assert len(want) == 1
    for name, layout in LAYOUTS.items():
        for got in world2.run(eval_losses, layout, str(tmp_path / name)):
            assert got == pytest.approx(want, rel=2e-6), name


def test_every_layout_reads_the_same_samples():
    one = eval_indices(5, samples=8, dp=1, dp_rank=0, micro_batch=2)
    two = [b for r in range(2) for b in eval_indices(5, samples=8, dp=2, dp_rank=r,
                                                     micro_batch=2)]
    assert sorted(i for b in one for i in b) == sorted(i for b in two for i in b)
    assert [i for b in one for i in b] == [0, 1, 2, 3, 4, 0, 1, 2]  # wraps a short split
    with pytest.raises(ValueError, match="train.eval_samples=8 or train.eval_samples=12"):
        eval_indices(5, samples=10, dp=2, dp_rank=0, micro_batch=2)

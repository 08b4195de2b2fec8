"""A resume compares the checkpoint's recorded settings with the run's: an exact change (the LR,
train.steps) is one log line and the run goes on; one that would read other tokens or another
order (train.seed, the tokenizer) is refused before any tensor is read, unless
train.resume_changes=allow."""

from __future__ import annotations

import logging

from tests.conftest import get_world
from tests.parallel.trainer_runs import run_trainer


def _resume(overrides: list[str], run_dir: str, steps: int):
    """Rank side: run to `steps` with `overrides`; (the steps run, log lines of the resume
    check) or the refusal's text."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("hpctrain.checkpoint.resume_changes")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trainer = run_trainer(overrides, run_dir, steps=steps)
        return trainer.steps_run, records
    except ValueError as err:
        return None, [str(err)]
    finally:
        logger.removeHandler(handler)


def test_exact_changes_are_logged_and_inexact_ones_refused(tmp_path):
    world, run = get_world(1), str(tmp_path / "run")
    assert world.run(_resume, [], run, 2)[0] == (2, [])
    ran, lines = world.run(_resume, ["optim.lr=1e-3"], run, 3)[0]
    assert ran == 1 and lines == ["optim.lr: 0.003 → 0.001 since the checkpoint",
                                  "train.steps: 2 → 3 since the checkpoint"]
    ran, lines = world.run(_resume, ["train.seed=7"], run, 4)[0]
    assert ran is None
    assert "train.seed=1234 in the checkpoint, 7 now" in lines[0]
    assert "train.resume_changes=allow" in lines[0] and "train.resume=never" in lines[0]
    ran, lines = world.run(_resume, ["train.seed=7", "train.resume_changes=allow"], run, 4)[0]
    assert ran == 1
    assert "train.seed: 1234 → 7 since the checkpoint (the data read changes)" in lines
    # issue 45: a finished run met with other settings (a second sweep into the same sweep
    # directory) reported the old results as its own; refused, while the same run is complete
    ran, lines = world.run(_resume, ["train.seed=7", "train.resume_changes=allow",
                                     "optim.lr=1e-3"], run, 4)[0]
    assert ran is None and "ends a finished run, and this run changes optim.lr" in lines[0]
    assert world.run(_resume, ["train.seed=7", "train.resume_changes=allow"], run, 4)[0][0] == 0


def test_what_counts_as_inexact():
    """None: a checkpoint of an older hpctrain records nothing to compare. Cadence and the
    invocation's own keys are quiet; the tokenizer is inexact, the batch size exact."""
    from hpctrain.checkpoint.resume_changes import compare, recorded
    from tests.conftest import make_config

    cfg = make_config([], run_dir="/tmp")
    assert compare(None, cfg) == ([], [])
    saved = recorded(make_config(["train.stop_after=5", "data.workers=3"], run_dir="/tmp"))
    assert compare(saved, cfg) == ([], [])
    saved = recorded(make_config(["data.tokenizer=bpe", "train.global_batch_size=32"],
                                 run_dir="/tmp"))
    lines, inexact = compare(saved, cfg)
    assert inexact == ["data.tokenizer"] and len(lines) == 2
    assert "train.global_batch_size: 32 → 16 since the checkpoint" in lines

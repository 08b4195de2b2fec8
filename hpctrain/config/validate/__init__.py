"""Validation: every mistake a user can make becomes one ValueError before any rank starts.

A rule is a `Check` (hpctrain.config.rule): a function of the Config that returns its problems
(each message names the values and the fix), declared with the keys it reads, where it is
written:

    @check("parallel.cp", "train.seq_len", "model.")
    def check_cp(c: Config) -> list[str]: ...

The first key is the one its problems are reported under; "group." reads every key of a group.
A rule lives beside the knowledge it needs: the layout's, the model's, the batch's and the
devices' here (`layout`, `model`, `batch`, `pipeline`, `cluster`, `device`), a task group's in
its module (`hpctrain.config.plan`, ...), the data's in `hpctrain.data.checks`, the LR
schedule's in `hpctrain.train.optim`, the planner's in `hpctrain.plan.checks`. Which rules a
task runs is its entry in the task registry (`hpctrain.tasks`).

Key-level problems come first: types and unknown keys (`hpctrain.config.build`), choices and
ranges (`keys`). Then the checks: those of `stage="input"` (one key each: the launcher, paths)
before the cross-field ones, each skipped when a key it reads was already reported, so none
divides by zero, builds a fix from a bad value or repeats a problem. A check with `data=True`
reads the data or the checkpoints, and runs only where the task reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

from hpctrain.config.build import Problem
from hpctrain.config.rule import Check
from hpctrain.config.schema import Config
from hpctrain.config.validate.keys import key_problems


def problems_of(c: Config, checks: Sequence[Check], *, reads_data: bool,
                found: Sequence[Problem] = ()) -> list[Problem]:
    """Every problem of `c`: `found` (from building it), choices and ranges, then `checks`,
    inputs first, each skipped if a key it reads was already reported (module docstring)."""
    problems = [*found, *key_problems(c)]
    if "task" in {p.key for p in problems}:
        return problems
    wanted = [k for k in checks if reads_data or not k.data]
    for stage in ("input", "derived"):
        failed = {p.key for p in problems}
        problems += [Problem(k.key, text) for k in wanted
                     if k.stage == stage and not _reads_any(k.reads, failed) for text in k(c)]
    return problems


def _reads_any(reads: tuple[str, ...], failed: set[str]) -> bool:
    return any(key == r or key.startswith(r if r.endswith(".") else r + ".")
               for r in reads for key in failed)

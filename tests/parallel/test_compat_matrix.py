"""The composition matrix, run: every pair of features that hpctrain.config.validate accepts
(hpctrain.tasks.compat) is trained together, inside one of the runs `compat.covering_runs` groups
the pairs into, and each run's loss and gradient norm per step follow the single process
(the same model, data, precision and experts, one rank, no checkpointing, eager) from the
same seed. Each run trains the very Config the matrix validated (`compat.config`), built
once here and sent to the ranks. A feature that changed the math of any pair it is in would
fail its run.

Tolerances (relative, per step): fp32 runs, loss 1e-5 and grad norm 1e-4
(assert_trajectory_close). Runs in bf16 differ from the single process by bf16's roundings in
another order (measured over this matrix's runs: loss up to 5.1e-5, norm up to 2.9e-3);
FP8 runs also by the dynamic scales, each rank's amax of its own rows under cp, and by bf16
differences that flip float8 roundings (measured: loss up to 1.6e-4, norm up to 4.5e-3).
Allowed: LOW_PRECISION. Compiled runs compile at least one graph, time it, and compile none
after the second step.
"""

from __future__ import annotations

import os

import pytest

from hpctrain.tasks import compat
from tests.conftest import get_world
from tests.parallel.compat_runs import trajectory
from tests.parallel.trainer_runs import assert_trajectory_close, logged_trajectory

STEPS = 3
RUN = {"train.steps": STEPS, "optim.warmup_steps": 1, "data.max_bytes": 200_000,
       "logger.plot": False}
if "HPCTRAIN_CACHE" in os.environ:  # as conf/data does
    RUN["data.cache_dir"] = os.environ["HPCTRAIN_CACHE"]
# What the single process shares with a run: everything but the layout and the features
# that must not change the math (activation checkpointing, compile).
_SAME_MATH = ("model.moe.", "train.precision", "train.fp8", "data.packing")
LOW_PRECISION = {"bf16": (2e-4, 1e-2), "fp8": (5e-4, 1e-2)}  # (loss, norm)


_references: dict[tuple, list] = {}


def _reference(run: tuple[str, ...], tmp_path_factory) -> list:
    same = {k: v for k, v in compat.combine(run).items() if k.startswith(_SAME_MATH)}
    key = tuple(sorted(same.items()))
    if key not in _references:
        cfg = compat.config((), run_dir=str(tmp_path_factory.mktemp("single")),
                            more={**RUN, **same})
        _references[key] = get_world(1).run(trajectory, cfg, False)[0][0]
    return _references[key]


RUNS = [pytest.param(run, id="+".join(run), marks=[pytest.mark.world8]
                     if compat.ranks(compat.combine(run)) == 8 else [])
        for run in compat.covering_runs()]


@pytest.mark.parametrize("run", RUNS)
def test_run_follows_single_process(run, tmp_path, tmp_path_factory):
    cfg = compat.config(run, run_dir=str(tmp_path), more=RUN)
    compiled = "compile" in run
    results = get_world(cfg.parallel.world_size).run(trajectory, cfg, compiled)
    got = logged_trajectory([trajectory for trajectory, _ in results])
    want = _reference(run, tmp_path_factory)
    low = [LOW_PRECISION[name] for name in ("fp8", "bf16") if name in run]
    if low:
        (rel_loss, rel_norm), = low[:1]
        assert len(got) == len(want)
        for (loss, norm), (loss1, norm1) in zip(got, want, strict=True):
            assert loss == pytest.approx(loss1, rel=rel_loss)
            assert norm == pytest.approx(norm1, rel=rel_norm)
    else:
        assert_trajectory_close(got, want)
    for _, stats in results if compiled else ():
        assert stats["compiled_graphs"] >= 1 and stats["compile_s"] > 0, stats
        assert 1 <= stats["compiled_graphs_train_step"] <= stats["compiled_graphs"], stats
        assert stats["recompiles_after_warmup"] == 0, stats

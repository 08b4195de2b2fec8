"""The composition matrix, run: every pair of features that hpctrain.validate accepts
(hpctrain.compat) is trained together, inside one of the runs `compat.covering_runs` groups
the pairs into, and each run's loss and gradient norm per step follow the single process
(the same model, data, precision and experts, one rank, no checkpointing, eager) from the
same seed. A feature that changed the math of any pair it is in would fail its run.

Tolerances (relative, per step): fp32 runs, loss 1e-5 and grad norm 1e-4
(assert_trajectory_close). Runs in bf16 differ from the single process by bf16's roundings in
another order (measured over this matrix's runs: loss up to 5.1e-5, norm up to 2.9e-3);
FP8 runs also by the dynamic scales, each rank's amax of its own rows under sp and cp
(measured: loss up to 1.6e-4, norm up to 4.5e-3). Allowed: LOW_PRECISION. Compiled runs
compile at least one graph, time it, and compile none after the second step.
"""

from __future__ import annotations

import pytest
import torch

from hpctrain import compat
from tests.conftest import get_world
from tests.parallel.trainer_runs import assert_trajectory_close, logged_trajectory, run_trainer

STEPS = 3
RUN_BASE = ("model=debug", "optim.warmup_steps=1", "data.max_bytes=200000")
# What the single process shares with a run: everything but the layout and the features
# that must not change the math (activation checkpointing, compile).
_SAME_MATH = ("model.moe.", "train.precision", "train.fp8", "data.packing")
LOW_PRECISION = {"bf16": (2e-4, 1e-2), "fp8": (5e-4, 1e-2)}  # (loss, norm)


def _trajectory(overrides: list[str], run_dir: str, compiled: bool):
    if compiled:  # a clean dynamo per run: graphs of earlier runs neither help nor count
        torch._dynamo.reset()
    trainer = run_trainer(overrides, run_dir, steps=STEPS, base=RUN_BASE)
    got = [(h["loss"], h["grad_norm"]) for h in trainer.history]
    return got, trainer.compile_watch.summary() if compiled else None


def _reference_overrides(run: tuple[str, ...]) -> list[str]:
    single = [o for o in compat.overrides(run) if o.startswith(_SAME_MATH)]
    return sorted(single)


_references: dict[tuple[str, ...], list] = {}


def _reference(run: tuple[str, ...], tmp_path_factory) -> list:
    key = tuple(_reference_overrides(run))
    if key not in _references:
        base = [o for o in compat.overrides(()) if not o.startswith("cluster.procs_per_node")]
        _references[key] = get_world(1).run(
            _trajectory, [*base, *key], str(tmp_path_factory.mktemp("single")), False)[0][0]
    return _references[key]


RUNS = [pytest.param(run, id="+".join(run), marks=[pytest.mark.world8]
                     if compat.ranks(compat.combine(run)) == 8 else [])
        for run in compat.covering_runs()]


@pytest.mark.parametrize("run", RUNS)
def test_run_follows_single_process(run, tmp_path, tmp_path_factory):
    overrides = compat.overrides(run)
    compiled = "compile" in run
    results = get_world(compat.ranks(compat.combine(run))).run(
        _trajectory, overrides, str(tmp_path), compiled)
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

"""Trainer with parallel.tp=2 (with and without sp) follows the tp=1 loss trajectory (fp32)."""

from __future__ import annotations

import pytest

from hpctrain.parallel.tensor import tp_activation_bytes
from tests.conftest import get_world
from tests.parallel.trainer_runs import run_trainer

STEPS = 3


def _train(overrides: list[str], run_dir: str):
    # train=debug's own batch and warmup, evaluated at the last step.
    trainer = run_trainer(["train.global_batch_size=4", "optim.warmup_steps=20",
                           "train.eval_every=3", *overrides], run_dir, steps=STEPS)
    return [(h["loss"], h["grad_norm"], h.get("comm_tp_bytes"), h.get("eval_loss"))
            for h in trainer.history]


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_trainer_matches_tp1(sp, world2, tmp_path):
    ref = get_world(1).run(_train, [], str(tmp_path / "tp1"))[0]
    runs = world2.run(_train, ["parallel.tp=2", f"parallel.sp={str(sp).lower()}"],
                      str(tmp_path / "tp2"))
    assert runs[0] == runs[1]  # tp ranks agree exactly on the replicated loss and norm
    for (loss, norm, _comm, ev), (loss1, norm1, comm1, ev1) in zip(runs[0], ref, strict=True):
        assert loss == pytest.approx(loss1, rel=1e-5, abs=1e-6)
        assert norm == pytest.approx(norm1, rel=1e-4)
        assert ev == pytest.approx(ev1, rel=1e-5) if ev1 is not None else ev is None
        assert comm1 is None
    # train=debug: 2 micro-batches of 2 × 64 tokens, fp32 activations and loss
    per_micro = tp_activation_bytes(tp=2, n_layers=4, batch=2, seq=64, dim=32, elem_bytes=4)
    grad_sync = 0 if not sp else 2 * 1 * 4 * (2 * 4 + 1) * 32 // 2  # norm gains, fp32
    assert runs[0][0][2] == 2 * per_micro + grad_sync

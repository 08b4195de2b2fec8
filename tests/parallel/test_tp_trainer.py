"""Trainer with parallel.tp=2 (with and without sp) follows the tp=1 loss trajectory (fp32)."""

from __future__ import annotations

import pytest
import torch

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


QWEN_LIKE = ["model.attention_bias=true", "model.qk_norm=true", "model.head_dim=16"]


def _train_qk(overrides: list[str], run_dir: str):
    """`_train`, and the q/k norm gains after the last step."""
    trainer = run_trainer(["train.global_batch_size=4", "optim.warmup_steps=20", *overrides],
                          run_dir, steps=STEPS)
    gains = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
             if n.endswith(("q_norm.weight", "k_norm.weight"))}
    return [(h["loss"], h["grad_norm"]) for h in trainer.history], gains


def test_tp_with_biases_and_qk_norms_matches_tp1(tmp_path, world2):
    """The trainer syncs the q/k norm gains' partial gradients over tp: both ranks step them
    identically (they diverge without the sum), following tp=1's loss and norm."""
    ref, ref_gains = get_world(1).run(_train_qk, QWEN_LIKE, str(tmp_path / "tp1"))[0]
    runs = world2.run(_train_qk, [*QWEN_LIKE, "parallel.tp=2"], str(tmp_path / "tp"))
    (hist, gains), (hist1, gains1) = runs
    assert hist == hist1 and gains.keys() == ref_gains.keys() and len(gains) == 8
    assert all(torch.equal(gains[n], gains1[n]) for n in gains)
    for (loss, norm), (loss1, norm1) in zip(hist, ref, strict=True):
        assert loss == pytest.approx(loss1, rel=1e-5, abs=1e-6)
        assert norm == pytest.approx(norm1, rel=1e-5)
    for name, gain in gains.items():
        torch.testing.assert_close(gain, ref_gains[name], rtol=1e-5, atol=1e-6)

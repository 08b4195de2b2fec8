"""model.init_from under tp=2 and pp=2: the first step's loss equals transformers' loss on the
same batch, and under tp=2 each rank reads only its share of the weights' bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.hf_models import save_tiny_llama
from tests.parallel.trainer_runs import BASE, run_trainer

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _first_step(overrides: list[str], run_dir: str, steps: int = 1):
    """Rank side: `steps` steps from the imported weights; (the first loss, this rank's bytes
    read by the import, the first step's micro-batches)."""
    base = tuple(o for o in BASE if not o.startswith("model="))
    # packing=none: each row is one sequence, as transformers reads it
    trainer = run_trainer(["model=hf", "data.packing=none", *overrides], run_dir, steps=steps,
                          base=base)
    return trainer.history[0]["loss"], trainer.init_bytes_read, list(trainer.micro_batches(0))


def _hf_loss(hf, micro) -> float:
    """transformers' loss of the step: mean over each micro-batch's tokens, then over them."""
    with torch.no_grad():
        losses = [F.cross_entropy(hf(inputs).logits.flatten(0, 1), targets.flatten())
                  for inputs, targets, _ in micro]
    return torch.stack(losses).mean().item()


@pytest.mark.parametrize(("layout", "tied"), [("parallel.tp=2", False),
                                              ("parallel=pp2", True),
                                              ("parallel.dp=2 parallel.zero=3", True)])
def test_first_step_loss_equals_transformers(world2, tmp_path, layout, tied):
    hf = save_tiny_llama(tmp_path / "hf", tied=tied)
    runs = world2.run(_first_step, [f"model.init_from={tmp_path / 'hf'}", *layout.split()],
                      str(tmp_path / "run"))
    loss = next(r[0] for r in runs if r[0] == r[0])  # pp: the last stage's rank reports it
    micro = [m for r in runs for m in r[2]]  # dp: both ranks' batches (tp, pp: the same twice)
    assert loss == pytest.approx(_hf_loss(hf, micro), rel=1e-5, abs=1e-6)
    files = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    total = sum(t.numel() * 4 for t in files.values())
    reads = [r[1] for r in runs]
    if layout == "parallel.tp=2":  # norm gains whole on each rank, every matrix halved
        share = sum(t.numel() * 4 // (1 if name.endswith("norm.weight") else 2)
                    for name, t in files.items())
        assert reads == [share, share] and share < 0.6 * total
    if "zero=3" in layout:  # every element read once, by the rank whose shard holds it
        assert sum(reads) == total and max(reads) < 0.6 * total

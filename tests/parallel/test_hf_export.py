"""task=export round trip: import a tiny Llama, train 2 steps at tp=2, export; transformers
loads the directory and its logits equal hpctrain's from the same checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hpctrain.checkpoint.hf_export import export_summary
from hpctrain.dispatch import launch
from tests.conftest import get_world, make_config
from tests.hf_models import save_tiny_llama
from tests.parallel.test_hf_import import _first_step

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOKENS = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(2))


def _logits_from(checkpoint: str, directory: str, run_dir: str) -> torch.Tensor:
    """Rank side (one process): hpctrain's logits after resuming `checkpoint` (which takes
    precedence over model.init_from), before any step."""
    from tests.parallel.trainer_runs import BASE, run_trainer

    base = tuple(o for o in BASE if not o.startswith("model="))
    trainer = run_trainer(["model=hf", f"model.init_from={directory}", "data.packing=none",
                           f"train.resume={checkpoint}"], run_dir, steps=3, base=base,
                          run=False)
    trainer.resume()
    with torch.no_grad():
        return trainer.model(TOKENS)


def test_export_round_trip_after_tp2_training(world2, tmp_path):
    save_tiny_llama(tmp_path / "hf", tied=True)
    world2.run(_first_step, [f"model.init_from={tmp_path / 'hf'}", "parallel.tp=2"],
               str(tmp_path / "run"), 2)
    out = tmp_path / "export"
    cfg = make_config(["task=export", f"export.from={tmp_path / 'run'}", f"export.out={out}",
                       "export.dtype=fp32", "export.max_shard_mb=0.2"], run_dir=tmp_path)
    summary = launch(cfg)
    assert len(summary["files"]) > 1  # sharded, with an index
    ckpt = summary["checkpoint"]
    assert ckpt.endswith("step_00000002")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    ours = get_world(1).run(_logits_from, ckpt, str(tmp_path / "hf"), str(tmp_path / "r1"))[0]
    assert (ours - theirs).abs().max().item() <= 1e-5
    imported = json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    skip = {"dtype", "torch_dtype", "transformers_version"}
    assert {k: v for k, v in exported.items() if k in imported and k not in skip} == {
        k: imported[k] for k in exported if k in imported and k not in skip}
    # issue 45: the files as readable as the umask allows (safetensors wrote 0600), the export
    # named, and a newer checkpoint that does not verify is said, not silently passed over
    umask = os.umask(0)
    os.umask(umask)
    assert all((out / f).stat().st_mode & 0o777 == 0o666 & ~umask for f in summary["files"])
    damaged = tmp_path / "run" / "checkpoints" / "step_00000009"
    damaged.mkdir()
    (damaged / "manifest.json").write_text("{not json")
    again = launch(make_config(["task=export", f"export.from={tmp_path / 'run'}",
                                f"export.out={tmp_path / 'again'}"], run_dir=tmp_path))
    text = export_summary(again)
    assert again["checkpoint"] == ckpt and "step_00000002 (step 2" in text
    assert f"warning: skipped the newer {damaged}" in text
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="export.out=.*afile is a file"):
        make_config(["task=export", f"export.from={tmp_path / 'run'}",
                     f"export.out={tmp_path / 'afile'}"], run_dir=tmp_path)


def test_export_every_writes_each_kept_checkpoint_while_training(world2, tmp_path):
    """train.export_every=2 with checkpoints every step kept every 2: steps 2 and 4 exported
    by the logging rank during the run (bf16 by default), each loadable by transformers;
    a bad setting is refused before launch."""
    save_tiny_llama(tmp_path / "hf", tied=True)
    settings = ["train.checkpoint_every=1", "train.keep_every=2", "train.export_every=2"]
    world2.run(_first_step, [f"model.init_from={tmp_path / 'hf'}", "parallel.dp=2", *settings],
               str(tmp_path / "run"), 4)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [e["step"] for e in summary["exports"]] == [2, 4]
    assert all("error" not in e for e in summary["exports"])
    for step in (2, 4):
        out = tmp_path / "run" / "hf" / f"step_{step:08d}"
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"train.export_every=3 is not a multiple of train."
                                         r"keep_every=2"):
        make_config(["train.checkpoint_every=1", "train.keep_every=2", "train.export_every=3"],
                    run_dir=tmp_path)
    with pytest.raises(ValueError, match=r"model debug_moe has no exact Hugging Face form"):
        make_config(["model=debug_moe", *settings], run_dir=tmp_path)

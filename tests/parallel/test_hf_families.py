"""Qwen2, Qwen3 and Mixtral through hpctrain and back: import under a parallel layout (the
first step's loss equals transformers' on the same batch), train, export, and transformers'
logits of the export equal hpctrain's of the same checkpoint; Mixtral's round trip is exact."""

from __future__ import annotations

import json

import pytest
import torch

from hpctrain.checkpoint.one_device import load_one_device
from hpctrain.dispatch import launch
from tests.conftest import make_config
from tests.hf_models import FAMILIES
from tests.parallel.test_hf_import import _first_step, _hf_loss

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOKENS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
EXACT = ["optim.lr=1e-30", "optim.min_lr=0"]  # no fp32 weight moves: the export is the import
CASES = [
    ("qwen3", ["parallel.tp=2"]),  # q/k norms beside the heads each rank holds
    ("qwen3", ["parallel=pp2"]),
    ("qwen2", ["parallel.tp=2"]),  # the biases sharded with their heads
    ("qwen2", ["parallel=pp2"]),  # the biases inside the stages, the tied head on the last one
    ("mixtral", ["parallel.tp=2"]),  # attention sharded, the experts whole on each rank
    ("mixtral", ["parallel=pp2"]),
    # experts split over ep (each rank reads its experts' boxes), exported bit for bit
    ("mixtral", ["parallel.dp=2", "parallel.ep=2", *EXACT]),
]


@pytest.mark.parametrize(("family", "layout"), CASES,
                         ids=[f"{f}-{'-'.join(x.split('.')[-1] for x in lay[:2])}"
                              for f, lay in CASES])
def test_import_train_export_round_trip(world2, tmp_path, family, layout):
    hf = FAMILIES[family]()
    hf.save_pretrained(tmp_path / "hf")
    runs = world2.run(_first_step, [f"model.init_from={tmp_path / 'hf'}", *layout],
                      str(tmp_path / "run"), 2)
    loss = next(r[0] for r in runs if r[0] == r[0])  # pp: the last stage's rank reports it
    dp = "parallel.dp=2" in layout  # both ranks' batches; tp and pp ranks read the same
    micro = [m for r in runs for m in r[2]] if dp else runs[0][2]
    assert loss == pytest.approx(_hf_loss(hf, micro), rel=1e-5, abs=1e-6)

    out = tmp_path / "export"
    launch(make_config(["task=export", f"export.from={tmp_path / 'run'}", f"export.out={out}",
                        "export.dtype=fp32"], run_dir=tmp_path))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ours = load_one_device(from_=str(tmp_path / "run")).model
    with torch.no_grad():
        theirs = exported.eval()(TOKENS).logits
        assert (ours(TOKENS) - theirs).abs().max().item() <= 1e-5
    before = json.loads((tmp_path / "hf" / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    skip = {"dtype", "torch_dtype", "transformers_version", "architectures"}
    common = [k for k in after if k in before and k not in skip]
    assert {k: after[k] for k in common} == {k: before[k] for k in common}
    assert after["model_type"] == family
    if EXACT[0] in layout:
        original = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
        written = {}
        for file in sorted(out.glob("*.safetensors")):
            written.update(safetensors_torch.load_file(file))
        assert written.keys() == original.keys()
        assert all(torch.equal(written[k], original[k]) for k in original)

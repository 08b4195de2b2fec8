"""The planner counts what a family's model holds, not a second description of it (issue 43): a
tiny Qwen2 (q/k/v biases, a tied head), a Qwen3 (q/k norms, head_dim ≠ dim / heads) and a
Mixtral (a router and routed experts) imported with model=hf hold exactly the model-state bytes
the planner predicts — the run summary's mem_model_state_ratio is 1 — alone, at tp = 2 and at
ZeRO-3 over dp = 2. (The planner's own block used to leave out the biases and the q/k norms:
1.0018 for the Qwen2.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpctrain import dispatch
from tests.conftest import make_config
from tests.hf_models import FAMILIES

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

RUN = ["model=hf", "train=debug", "train.steps=1", "train.eval_every=0", "logger.wandb=disabled",
       "logger.plot=false", "logger.progress=plain", "data.max_bytes=200000",
       "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32"]
LAYOUTS = {"single": [], "tp2": ["parallel.tp=2"],
           "zero3_dp2": ["parallel.dp=2", "parallel.zero=3"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, build in FAMILIES.items():
        build().save_pretrained(root / name)
        out[name] = root / name
    return out


def _train_on_rank(overrides: list[str], run_dir: str) -> None:
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.tasks.train import run_train

    cfg = make_config(overrides, run_dir=run_dir)
    run_train(cfg, build_mesh(cfg.parallel.dims, rank=dist.get_rank(),
                              device=torch.device("cpu")))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_state_bytes_are_the_planners(world2, saved, tmp_path, family, layout):
    over = [*RUN, f"model.init_from={saved[family]}", *LAYOUTS[layout]]
    if LAYOUTS[layout]:
        world2.run(_train_on_rank, [*over, "cluster.procs_per_node=2"], str(tmp_path))
    else:
        dispatch.run(make_config(over, run_dir=tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mem_model_state_bytes"] == summary["predicted_mem_model_state_bytes"]
    assert summary["mem_model_state_ratio"] == 1

"""One update path for every layout: the trainer's engine is the data-parallel engine with the
same parameter and master dtypes on a pipeline as on data parallelism (bf16 means 16-bit
parameters with fp32 masters everywhere)."""

from __future__ import annotations

import pytest
import torch

from hpctrain.parallel.data.engine import DataParallel
from tests.conftest import get_world
from tests.parallel.trainer_runs import run_trainer


def _engine_dtypes(overrides: list[str], run_dir: str) -> dict:
    trainer = run_trainer([*overrides, "train.precision=bf16"], run_dir, steps=1)
    engine = trainer.dp
    assert isinstance(engine, DataParallel)
    assert trainer.optimizer is engine.optimizer
    return {"params": {str(p.dtype) for p in trainer.model.parameters()},
            "masters": {str(s["master"].dtype) for s in engine.optimizer.state.values()},
            "moments": {str(s["exp_avg"].dtype) for s in engine.optimizer.state.values()}}


def test_bf16_pipeline_and_dp_share_the_engine_dtypes(world2, tmp_path):
    want = {"params": {str(torch.bfloat16)}, "masters": {str(torch.float32)},
            "moments": {str(torch.float32)}}
    for layout in (["parallel=pp2"], ["parallel=dp2"], ["parallel=pp2", "parallel.zero=1"]):
        got = world2.run(_engine_dtypes, layout, str(tmp_path / "_".join(layout)))
        assert got == [want, want], (layout, got)


def _bf16_losses(overrides: list[str], run_dir: str) -> list[float]:
    trainer = run_trainer([*overrides, "train.precision=bf16"], run_dir, steps=3)
    return [h["loss"] for h in trainer.history]


def test_bf16_pipeline_trains_like_one_process(world2, tmp_path):
    """bf16 activations cross the pipeline in the parameters' dtype: pp=2 with m=4 follows the
    single-process bf16 trajectory (both run the same engine in the same dtypes)."""
    one = get_world(1).run(_bf16_losses, [], str(tmp_path / "one"))[0]
    for schedule in ("1f1b", "zb_h1"):
        pp = world2.run(_bf16_losses, ["parallel=pp2", f"parallel.schedule={schedule}"],
                        str(tmp_path / schedule))
        for losses in pp:
            assert losses == pytest.approx(one, rel=1e-3), (schedule, losses, one)

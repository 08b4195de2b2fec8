"""One update path for every layout: the trainer's engine is the data-parallel engine with the
same parameter and master dtypes on a pipeline as on data parallelism (bf16 means 16-bit
parameters with fp32 masters everywhere)."""

from __future__ import annotations

import torch

from hpctrain.parallel.data.engine import DataParallel
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

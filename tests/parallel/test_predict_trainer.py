"""Training runs log the planner's prediction next to what they measure (issue 8).

Memory: on the flat engine (tp = pp = 1) the predicted per-rank model states equal the ledger
to the byte, padding included, in fp32 and bf16. Step time: on CPU, with the device's peak
measured by the run's own GEMM, the prediction is within STEP_FACTOR (an order of magnitude)
of the measured median.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import get_world, make_config

# An order-of-magnitude check, not a speed goal: CI machines are shared and loaded, and a timed
# assertion must not flake. It still catches unit and formula errors (×1000, a lost factor of
# tokens). Ratios seen on this 2-core machine: dp1 1.4, dp2 2.8, tp2 4.8 when quiet and up to
# 12.7 when other test suites ran beside it (tp2: 64 small gloo all-reduces per step).
STEP_FACTOR = {"dp1": 20.0, "dp2": 20.0, "tp2": 40.0}
# Big enough that matmuls, not Python overhead, dominate a step (model=debug: ~8x slower than
# predicted, all of it per-op overhead); still ~0.1 s per step on one CPU thread.
STEP_MODEL = ["model=tiny", "train.seq_len=128", "train.steps=5", "train.global_batch_size=8"]
BASE = ["model=debug", "train=debug", "logger.wandb=disabled", "data.max_bytes=200000",
        "train.resume=never", "train.eval_every=0"]
# dim 34 with one head (head_dim 34): every parameter is a multiple of 34 = 2·17, so units of
# odd multiples leave padding under dp = 4.
ODD = ["model.dim=34", "model.n_heads=1", "model.n_kv_heads=1", "model.ffn_dim=68"]


def _train(overrides: list[str], run_dir: str):
    from hpctrain.distributed.dims import ParallelDims
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.plan.predict import RunPrediction
    from hpctrain.train.trainer import Trainer

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    cfg = make_config([*BASE, f"cluster.procs_per_node={dist.get_world_size()}", *overrides],
                      run_dir=run_dir)
    p = cfg.parallel
    mesh = build_mesh(ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp), rank=dist.get_rank(),
                      device=torch.device("cpu"))
    prediction = RunPrediction(cfg, device=mesh.device, logging_rank=mesh.is_logging_rank)
    trainer = Trainer(cfg, mesh, prediction=prediction)  # as hpctrain.tasks.train.run_train does
    summary = trainer.run()
    padding = trainer.dp.padding() if trainer.dp is not None else None
    return summary, trainer.memory_metrics(), padding


def _first_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


def _check_memory(summary: dict, mem: dict) -> None:
    for key in ("mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes"):
        assert summary[f"predicted_{key}"] == mem[key], (key, summary[f"predicted_{key}"], mem)
    assert summary["mem_model_state_ratio"] == 1.0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp2_predicted_model_states_equal_the_ledger(world2, tmp_path, zero, precision):
    over = ["parallel.dp=2", f"parallel.zero={zero}", f"train.precision={precision}",
            "train.steps=2", "parallel.bucket_mb=0.02"]  # 20 KiB buckets: several units
    (summary, mem, _), (_, mem1, _) = world2.run(_train, over, str(tmp_path), timeout_s=120)
    _check_memory(summary, mem)
    ledger = ("mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes")
    assert [mem1[k] for k in ledger] == [mem[k] for k in ledger]  # every dp rank holds the same
    first = _first_record(tmp_path)
    assert first["predicted_mem_model_state_bytes"] == summary["mem_model_state_bytes"]
    assert "predicted_step_time_s" in first


@pytest.mark.parametrize("zero", [1, 3])
def test_dp4_prediction_includes_the_flat_padding(tmp_path, zero):
    over = ["parallel.dp=4", f"parallel.zero={zero}", "train.steps=1", "train.global_batch_size=8",
            "parallel.bucket_mb=0.02", *ODD]
    results = get_world(4).run(_train, over, str(tmp_path), timeout_s=180)
    summary, mem, padding = results[0]
    assert padding > 0  # the case the Ψ-only formulas get wrong
    _check_memory(summary, mem)


@pytest.mark.parametrize("layout", [["parallel.dp=1"], ["parallel.dp=2"], ["parallel.tp=2"]],
                         ids=["dp1", "dp2", "tp2"])
def test_predicted_step_time_within_a_factor(world2, tmp_path, layout):
    world = get_world(1) if layout == ["parallel.dp=1"] else world2
    over = [*layout, *STEP_MODEL]
    summary = world.run(_train, over, str(tmp_path), timeout_s=180)[0][0]
    ratio = summary["step_time_ratio"]
    print(f"{layout}: measured {summary['step_time_s']:.4g} s, predicted "
          f"{summary['predicted_step_time_s']:.4g} s, ratio {ratio:.3g}")
    factor = STEP_FACTOR[{"parallel.dp=1": "dp1", "parallel.dp=2": "dp2"}.get(layout[0], "tp2")]
    assert 1 / factor <= ratio <= factor, summary

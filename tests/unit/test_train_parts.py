"""LR schedule, loss scaler, rank arithmetic and the environment reader."""

from __future__ import annotations

import math

import pytest
import torch

from hpctrain.config.schema import OptimConfig
from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.env import from_environ, slurm_port
from hpctrain.parallel.scaler import LossScaler
from hpctrain.train.optim import lr_at


def test_lr_warmup_then_cosine_to_min():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, o, total_steps=110) == pytest.approx(0.1)
    assert lr_at(9, o, total_steps=110) == pytest.approx(1.0)
    assert lr_at(60, o, total_steps=110) == pytest.approx(0.55)
    assert lr_at(110, o, total_steps=110) == pytest.approx(0.1)
    values = [lr_at(s, o, total_steps=110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_loss_scaler_skips_halves_and_grows():
    s = LossScaler(scale=1024.0, growth_interval=2)
    assert s.found_overflow([torch.tensor([1.0, math.inf])], group=None)
    assert not s.found_overflow([torch.tensor([1.0, 2.0])], group=None)
    s.update(True)
    assert s.scale == 512.0
    s.update(False)
    s.update(False)
    assert s.scale == 1024.0
    restored = LossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.scale == s.scale


def test_dims_tp_is_fastest_and_groups_partition_the_world():
    d = ParallelDims(dp=2, tp=2, pp=2)
    assert d.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert d.group_ranks("tp", 5) == [4, 5]
    assert d.group_ranks("dp", 5) == [5, 7]
    assert d.group_ranks("pp", 5) == [1, 5]
    for axis in ("pp", "dp", "tp"):
        groups = d.all_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))
    assert [r for r in range(8) if d.is_logging_rank(r)] == [4]


def test_env_from_torchrun_and_slurm():
    tr = from_environ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                       "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert (tr.rank, tr.local_rank, tr.world_size, tr.master_addr, tr.source) == (
        3, 1, 4, "h0", "torchrun")
    sl = from_environ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
                       "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08,10]"})
    assert (sl.rank, sl.local_rank, sl.world_size, sl.master_addr) == (5, 1, 8, "gpu07")
    assert sl.master_port == slurm_port("4242") and 10000 <= sl.master_port < 32000
    # array tasks: each has its own SLURM_JOB_ID, so two points of a sweep never share a port,
    # and no port lies in Linux's default ephemeral range (32768-60999)
    task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
            "SLURM_ARRAY_JOB_ID": "73"}
    ports = {from_environ({**task, "SLURM_JOB_ID": str(73 + i), "SLURM_ARRAY_TASK_ID": str(i)})
             .master_port for i in range(100)}
    assert len(ports) == 100 and max(ports) < 32768
    assert {slurm_port(str(i)) for i in range(0, 10**6, 997)} <= set(range(10000, 32000))
    assert from_environ({}).source == "single"


def test_summary_medians_skip_only_the_runs_first_two_steps(tmp_path):
    """The trainer keeps the recent step records only; once the first two are evicted the
    whole window is steady state."""
    from hpctrain.train.outputs import summarize
    from tests.conftest import make_config

    cfg = make_config(["model=debug", "train=debug"], run_dir=tmp_path)
    recs = [{"tokens_per_s": v, "step_time_s": 1.0, "mfu": None, "loss": 1.0}
            for v in (1.0, 2.0, 10.0, 10.0, 10.0)]
    assert summarize(recs, cfg=cfg, run_dir=tmp_path, extra={})["tokens_per_s"] == 10.0
    window = recs[1:]  # step 1 evicted: only step 2 is still warm-up
    assert summarize(window, cfg=cfg, run_dir=tmp_path, extra={},
                     evicted=1)["tokens_per_s"] == 10.0
    assert summarize(recs[:3], cfg=cfg, run_dir=tmp_path, extra={},
                     evicted=5)["tokens_per_s"] == 2.0


def test_summary_counts_total_and_active_parameters(tmp_path):
    """MoE runs report active parameters and say MFU counts active FLOPs; dense runs one total."""
    import dataclasses

    from hpctrain.models import build_model
    from hpctrain.models.config import PRESETS
    from hpctrain.train.outputs import format_summary, summarize
    from tests.conftest import make_config

    cfg = make_config(["model=debug", "train=debug"], run_dir=tmp_path)
    recs = [{"tokens_per_s": 1.0, "step_time_s": 1.0, "mfu": None, "loss": 1.0}]
    dense = summarize(recs, cfg=cfg, run_dir=tmp_path, extra={})
    assert dense["params"] == PRESETS["debug"].num_params() and "params_active" not in dense
    moe_cfg = dataclasses.replace(cfg, model=PRESETS["debug_moe"])
    moe = summarize(recs, cfg=moe_cfg, run_dir=tmp_path, extra={})
    m = PRESETS["debug_moe"]  # the built model's count; top_k of the routed experts active
    total = sum(p.numel() for p in build_model(m, seed=0).parameters())
    idle = m.n_moe_layers * (m.moe.num_experts - m.moe.top_k) * 3 * m.dim * m.expert_ffn_dim
    assert (moe["params"], moe["params_active"]) == (total, total - idle)
    text = format_summary(moe)
    assert "params_active" in text and "mfu_flops              active" in text


def test_logger_plot_false_draws_no_plot_and_the_summary_names_none(tmp_path):
    """logger.plot=false: the run writes no training.png and its summary's outputs line does
    not name one (logger.plot=true, the default: tests/integration/test_train_run.py)."""
    from hpctrain.train.outputs import format_summary
    from tests.conftest import get_world
    from tests.parallel.trainer_runs import train_in_world

    get_world(1).run(train_in_world, [], str(tmp_path))  # BASE has logger.plot=false
    assert not (tmp_path / "training.png").exists()
    assert "training.png" not in format_summary({"run_dir": str(tmp_path), "plot": None})
    assert "training.png" in format_summary({"run_dir": str(tmp_path), "plot": "x.png"})

"""NCCL-style batched point-to-point: which lowered schedules complete, checked without GPUs."""

from __future__ import annotations

import pytest

import hpctrain.parallel.pipeline.batching as batching
from hpctrain.parallel.pipeline.actions import Action
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.schedules import build_schedule


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_batched_p2p_completes(name, pp, mult):
    batching.check_batched(lower_comm(build_schedule(name, pp=pp, microbatches=pp * mult)))


def test_one_op_at_a_time_deadlocks_1f1b(monkeypatch):
    """The reason for batching: sends that wait for their receive, issued alone, deadlock in
    1F1B's steady state, where neighbours send to each other at the same time."""
    grouped = batching.comm_groups

    def singles(actions):
        out = []
        for item in grouped(actions):
            out.extend([item] if isinstance(item, Action) else [(a,) for a in item])
        return out

    monkeypatch.setattr(batching, "comm_groups", singles)
    with pytest.raises(ValueError, match="deadlocks"):
        batching.check_batched(lower_comm(build_schedule("1f1b", pp=4, microbatches=8)))


def test_comm_groups_keep_order():
    s = lower_comm(build_schedule("1f1b", pp=2, microbatches=2))
    flat = [a for item in batching.comm_groups(s.actions[0])
            for a in ((item,) if isinstance(item, Action) else item)]
    assert tuple(flat) == s.actions[0]


@pytest.mark.parametrize("schedule,refused", [("zbv", True), ("1f1b", False)])
def test_nccl_check_in_validation(schedule, refused, tmp_path):
    import dataclasses

    from hpctrain.config.validate.pipeline import nccl_p2p_problems
    from tests.conftest import make_config

    cfg = make_config(["parallel=pp2", "cluster.procs_per_node=2", "model=debug",
                       f"parallel.schedule={schedule}", "train.global_batch_size=16",
                       "train.micro_batch_size=4"], run_dir=tmp_path)
    sched = build_schedule(schedule, pp=2, microbatches=cfg.grad_accum)
    assert nccl_p2p_problems(cfg, sched) == []  # gloo: tagged isend/recv, no constraint
    nccl = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, backend="nccl"))
    problems = nccl_p2p_problems(nccl, sched)
    assert bool(problems) == refused, problems
    if refused:
        assert "on NCCL use parallel.schedule=1f1b, zb_h1 or gpipe" in problems[0]

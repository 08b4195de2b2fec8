"""A run that outlives its nodes, without Slurm: the layout chosen for fewer nodes
(launch.elastic), the restart records (distributed.restarts), what the requeue decides and
runs (launch.requeue), and what a hang report blames (distributed.hang_report)."""

from __future__ import annotations

import json
import time

import pytest

from hpctrain.distributed import hang_report, restarts
from hpctrain.launch import elastic, requeue
from hpctrain.launch.resolvers import job_flags
from hpctrain.tasks import runnable_problems
from tests.conftest import make_config

ELASTIC = ["cluster=slurm_local", "cluster.elastic=true", "model=debug", "train=debug"]


@pytest.mark.parametrize("layout, nodes, kept", [
    (["parallel.dp=4", "train.global_batch_size=16"], 1, "dp2 tp1 pp1"),
    (["parallel.dp=2", "parallel.tp=2", "parallel.sp=true"], 1, "dp1 tp2 pp1"),
    (["parallel.dp=2", "parallel.pp=2", "train.global_batch_size=8"], 1, "dp1 tp1 pp2"),
    (["parallel.dp=4", "parallel.dp_replicate=2", "parallel.zero=2",
      "train.global_batch_size=16"], 1, "dp2 tp1 pp1"),
])
def test_fewer_nodes_keep_the_global_batch_and_run(layout, nodes, kept):
    cfg = make_config([*ELASTIC, *layout])
    fitted, note = elastic.fit_world(cfg, nodes)
    p = fitted.parallel
    assert fitted.cluster.nodes == nodes
    assert p.world_size == fitted.cluster.world_size == nodes * cfg.cluster.procs_per_node
    assert fitted.train.global_batch_size == cfg.train.global_batch_size
    assert fitted.grad_accum * fitted.train.micro_batch_size * p.dp == \
        cfg.train.global_batch_size
    assert runnable_problems(fitted) == []  # every axis valid at the new world
    assert fitted.layout_label.startswith(kept), note  # dp takes what tp·pp·cp leave
    assert "kept the model-parallel degrees" in note
    assert (p.tp, p.pp, p.cp, p.sp, p.zero) == (cfg.parallel.tp, cfg.parallel.pp,
                                               cfg.parallel.cp, cfg.parallel.sp,
                                               cfg.parallel.zero)


def test_a_world_no_layout_runs_on_names_what_was_tried():
    """6 ranks: dp6 splits no batch of 16 into micro-batches of 2, and the debug model's
    heads and layers divide by no factor 3 either."""
    cfg = make_config([*ELASTIC, "parallel.dp=8", "train.global_batch_size=16",
                       "train.eval_samples=48"])
    with pytest.raises(ValueError, match=r"no layout runs on 3 node\(s\) \(6 ranks\): "
                                         r"keeping the model-parallel degrees fails \(train"):
        elastic.fit_world(cfg, 3)


def test_an_hsdp_shard_group_stays_a_node():
    cfg = make_config([*ELASTIC, "cluster.procs_per_node=2", "parallel.dp=8",
                       "parallel.dp_replicate=4", "parallel.zero=3",
                       "train.global_batch_size=16", "train.eval_samples=16"])
    fitted, _ = elastic.fit_world(cfg, 2)
    assert (fitted.parallel.dp, fitted.parallel.dp_replicate) == (4, 2)


def test_the_configured_nodes_change_nothing_and_out_of_range_is_refused():
    cfg = make_config([*ELASTIC, "parallel.dp=4", "cluster.min_nodes=2",
                       "train.global_batch_size=16"])
    assert elastic.fit_world(cfg, 2)[0] is cfg
    with pytest.raises(ValueError, match="cluster.min_nodes=2"):
        elastic.fit_world(cfg, 1)


def test_a_kept_layout_that_no_longer_fits_is_searched_again():
    """ZeRO-3 over dp=2 × tp=2 is predicted at 1.56 MiB a rank, over dp=1 at 1.72 MiB: with
    1.7 MiB usable the kept layout does not fit one node, and the search finds one that does."""
    cfg = make_config([*ELASTIC, "parallel.dp=2", "parallel.tp=2", "parallel.zero=3",
                       "train.global_batch_size=8", "plan.memory_limit_gb=0.00185"])
    fitted, note = elastic.fit_world(cfg, 1)
    assert "is predicted to need" in note and "parallel=auto chose" in note, note
    assert runnable_problems(fitted) == [] and fitted.parallel.world_size == 2


def test_elastic_needs_slurm_and_a_sane_range():
    with pytest.raises(ValueError, match="cluster.elastic=true needs a Slurm cluster"):
        make_config(["cluster.elastic=true"])
    with pytest.raises(ValueError, match="cluster.min_nodes=3 exceeds cluster.nodes=2"):
        make_config([*ELASTIC, "parallel.dp=4", "cluster.min_nodes=3"])
    with pytest.raises(ValueError, match="cluster.max_restarts"):
        make_config(["cluster.max_restarts=-1"])


def test_job_flags_ask_for_a_node_range_only_when_elastic():
    assert job_flags(False, 1, 4) == {"requeue": True, "no_kill": True}
    assert job_flags(True, 2, 4) == {"requeue": True, "no_kill": True, "nodes": "2-4"}


def test_restart_records_count_exclude_and_describe(tmp_path):
    assert restarts.faults(tmp_path) == [] and restarts.complete(
        tmp_path, resumed_step=0, world=2, layout="x") is None
    restarts.record_fault(tmp_path, cause="node down", nodes=["n2"], step=43, world=4,
                          layout="dp4", job_id="7")
    assert restarts.excluded(tmp_path) == ["n2"] and len(restarts.faults(tmp_path)) == 1
    record = restarts.complete(tmp_path, resumed_step=25, world=2, layout="dp2")
    assert (record["steps_lost"], record["world_before"], record["world_after"]) == (18, 4, 2)
    assert restarts.pending(tmp_path) is None
    line, = (tmp_path / "restarts.jsonl").read_text().splitlines()
    assert {"time", "cause", "nodes", "resumed_step", "steps_lost", "world_before",
            "world_after"} <= set(json.loads(line))
    restarts.record_fault(tmp_path, cause="rank hung or lost", nodes=["n3"], step=9, world=2,
                          layout="dp2", job_id="7")
    assert restarts.excluded(tmp_path) == ["n2", "n3"]
    text = restarts.describe(restarts.faults(tmp_path))
    assert "1. " in text and "node down; excluded n2, resumed at step 25 (18 steps lost)" in text
    assert "2. " in text and "excluded n3, in step 9 (not resumed yet)" in text


def test_the_requeue_script_excludes_and_restores_the_node_range():
    plain = requeue.requeue_script("12", ["n2", "n5"])
    assert "scontrol requeue 12" in plain and "ExcNodeList=n2,n5 2>" in plain
    assert "NumNodes" not in plain and "trap '' TERM" in plain
    grown = requeue.requeue_script("12", ["n2"], node_range="1-4", min_tasks=8)
    assert "ExcNodeList=n2 NumNodes=1-4 NumTasks=8" in grown


def _fault(*, nodes=("n2",), error=None, ranks=(3,)):
    return hang_report.Fault(message="hang: ...", step=40, ranks=ranks, nodes=nodes,
                             error=error)


@pytest.fixture
def handler(tmp_path, monkeypatch):
    cfg = make_config([*ELASTIC, "parallel.dp=4", "cluster.max_restarts=2",
                       "cluster.exclude=n9", "train.global_batch_size=16"], run_dir=tmp_path)
    monkeypatch.setattr(requeue, "hostnames", lambda expr: expr.split(","))
    monkeypatch.setattr(requeue, "job_nodes", lambda job: ["n1", "n2"])
    ran = []
    monkeypatch.setattr(requeue.Requeue, "_requeue", lambda self, exclude: ran.append(exclude))
    h = requeue.Requeue(cfg, job_id="7", nodelist_at_start="n1,n2", layout="dp4",
                        most_nodes=2)
    return h, ran


def test_a_hung_rank_requeues_without_its_node_up_to_max_restarts(handler, tmp_path):
    h, ran = handler
    assert h._requeue_for(_fault()) is None and ran == [["n2", "n9"]]
    assert restarts.pending(tmp_path)["cause"] == "rank hung or lost"
    restarts.complete(tmp_path, resumed_step=30, world=2, layout="dp2")
    assert h._requeue_for(_fault(nodes=("n1",))) is None and ran[-1] == ["n1", "n2", "n9"]
    why = h._requeue_for(_fault(nodes=("n1",)))
    assert why.startswith("cluster.max_restarts=2 reached: the job ends") and len(ran) == 2
    assert "1. " in why and "2. " in why and "3. " in why


def test_a_lost_node_is_slurms_word_and_an_error_is_never_requeued(handler, monkeypatch,
                                                                   tmp_path):
    h, ran = handler
    why = h._requeue_for(_fault(error="ValueError: bad batch"))
    assert "a rank raised ValueError: bad batch" in why and ran == []
    monkeypatch.setattr(requeue, "job_nodes", lambda job: ["n1"])  # Slurm dropped n2
    assert h._requeue_for(_fault(nodes=("n1",))) is None
    assert restarts.pending(tmp_path)["cause"] == "node down" and ran == [["n2", "n9"]]


def test_only_gone_or_frozen_ranks_blame_their_node(tmp_path):
    now = time.time()
    beats_dir = tmp_path / "beats"
    beats_dir.mkdir()
    beats = {0: {"rank": 0, "host": "n1", "pid": 1, "step": 18, "phase": "train", "beat": now},
             1: {"rank": 1, "host": "n1", "pid": 1, "step": 31, "phase": "train", "beat": now},
             2: {"rank": 2, "host": "n2", "pid": 1, "step": 31, "phase": "train",
                 "beat": now - 60}}
    for r, b in beats.items():
        (beats_dir / f"rank_{r}.json").write_text(json.dumps(b))
    culprits = hang_report.suspects(beats, now=now, stale_s=8)
    assert [r for r, _ in culprits] == [2]
    assert hang_report.fault("m", step=31, culprits=culprits, beats=beats,
                             beats_dir=beats_dir).nodes == ("n2",)
    beats[2]["beat"] = now  # only rank 0 is behind: maybe just an older beat, no node blamed
    behind = hang_report.suspects(beats, now=now, stale_s=8)
    assert [r for r, _ in behind] == [0]
    assert hang_report.fault("m", step=31, culprits=behind, beats=beats,
                             beats_dir=beats_dir).nodes == ()
    beats[0]["phase"] = hang_report.FAILED + "KeyError: 'x'"
    raised = hang_report.suspects(beats, now=now, stale_s=8)
    assert raised[0] == (0, "raised KeyError: 'x' in step 18")
    assert hang_report.fault("m", step=31, culprits=raised, beats=beats,
                             beats_dir=beats_dir).error == "KeyError: 'x'"

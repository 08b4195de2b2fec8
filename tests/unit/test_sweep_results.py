"""The sweep summary reads every task's result file (issue 17, item 5)."""

import json

from hpctrain.launch.sweep import collect, markdown
from hpctrain.tasks.plan import run_plan
from hpctrain.tasks.simulate import run_simulate
from tests.conftest import make_config

PLAN = ["task=plan", "model=llama3_8b", "cluster.accelerator=H100-SXM", "train.seq_len=4096",
        "train.global_batch_size=64", "train.micro_batch_size=1", "parallel.dp=8",
        "cluster.procs_per_node=8"]


def test_simulate_plan_bench_and_train_points_are_ok(tmp_path):
    sim = make_config(["task=simulate", "parallel.pp=2", "parallel.microbatches=4"],
                      run_dir=tmp_path / "0")
    run_simulate(sim)
    run_plan(make_config(PLAN, run_dir=tmp_path / "1"))
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "bench.json").write_text(json.dumps(
        {"meta": {"name": "comm"}, "records": [{}, {}], "outliers": []}))
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "summary.json").write_text(json.dumps(
        {"steps": 4, "completed_steps": 4, "final_loss": 2.5, "tokens_per_s": 10.0}))
    (tmp_path / "3" / "plan.json").write_text("{}")  # the planner's, written before launch
    (tmp_path / "4").mkdir()  # a point that left nothing: failed
    rows = collect(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "ok", "failed"]
    assert [r.get("task") for r in rows] == ["simulate", "plan", "bench", "train", None]
    assert rows[0]["result"]["bubble_rate"] > 0 and rows[1]["result"]["step_time_s"] > 0
    assert rows[2]["result"] == {"bench": "comm", "records": 2, "outliers": 0}
    assert rows[3]["final_loss"] == 2.5
    table = markdown(rows)
    assert "| 0 | ok |" in table and "schedule=1f1b bubble_rate=" in table
    assert "final_loss" in table and "| 3 | ok |" in table and "point 4 failed" in table

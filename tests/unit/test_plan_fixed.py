"""parallel=auto keeps the layout keys a user gives beside it (`parallel.fixed`): the search
runs only over layouts that keep them, the log and plan.json say so, and a key it cannot keep
or a name it does not know is refused with the fix."""

from __future__ import annotations

import json
import logging

import pytest

from hpctrain.plan.auto import write_plan
from hpctrain.tasks import runnable_problems
from tests.conftest import make_config

AUTO = ["model=debug", "train=debug", "parallel=auto", "cluster.procs_per_node=4",
        "logger.wandb=disabled"]


def _layout(cfg) -> tuple:
    p = cfg.parallel
    return p.dp, p.tp, p.pp, p.zero, cfg.train.activation_checkpointing


def test_given_layout_keys_are_kept_and_the_rest_searched(tmp_path, caplog):
    free = make_config(AUTO, run_dir=tmp_path)
    assert free.parallel.fixed == () and free.parallel.pp * free.parallel.cp > 1, _layout(free)
    # pp=1 and cp=1 are the defaults: given, they are kept all the same
    kept = make_config([*AUTO, "parallel.pp=1", "parallel.cp=1",
                        "train.activation_checkpointing=full"], run_dir=tmp_path)
    assert kept.parallel.fixed == ("parallel.pp=1", "parallel.cp=1",
                                   "train.activation_checkpointing=full")
    assert kept.parallel.pp == kept.parallel.cp == 1, _layout(kept)
    assert kept.train.activation_checkpointing == "full"
    assert kept.parallel.dp * kept.parallel.tp == 4  # the rest searched

    with caplog.at_level(logging.INFO, logger="hpctrain.plan.auto"):
        doc = write_plan(kept, accept=runnable_problems)
    assert ("keeping parallel.pp=1, parallel.cp=1, train.activation_checkpointing=full as "
            "given") in caplog.text
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["fixed"] == doc["fixed"] == {"parallel.pp": 1, "parallel.cp": 1,
                                              "train.activation_checkpointing": "full"}
    assert all(" pp1 " in row["layout"] and " cp" not in row["layout"]
               and row["recompute"] == "full" for row in saved["top"]), saved["top"]


@pytest.mark.parametrize("overrides,words", [
    (["parallel.tp=3"], ["no layout of debug on 4 rank(s) keeps parallel.tp=3",
                         "change or drop them"]),
    (["parallel.pp=4", "plan.memory_limit_gb=0.001"],
     ["found no layout of debug on 4 rank(s) keeping parallel.pp=4 as given", "0.0009 GiB"]),
    (["parallel.fixed=[parallel.dpp]"], ["parallel.fixed has 'parallel.dpp'",
                                         "choose from parallel.dp, "]),
    (["parallel.fixed=['parallel.pp=two']"], ["parallel.fixed has 'parallel.pp=two'",
                                              "parallel.pp takes a whole number"]),
], ids=["cannot-keep", "none-fits", "unknown", "wrong-type"])
def test_a_key_auto_cannot_keep_is_refused(overrides, words, tmp_path):
    with pytest.raises(ValueError) as refused:
        make_config([*AUTO, *overrides], run_dir=tmp_path)
    assert all(w in str(refused.value) for w in words), str(refused.value)


def test_fixed_without_auto_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"parallel.fixed=\['parallel.dp'\] only applies to "
                                         "parallel=auto"):
        make_config(["model=debug", "train=debug", "parallel.fixed=[parallel.dp]"],
                    run_dir=tmp_path)


def test_the_plan_names_the_layout_that_runs_when_a_kept_key_does_not_bind_it(tmp_path):
    """virtual_stages binds pipelined layouts only: the winner may have none, and then holds
    v1. The value kept is the one given (2), so the plan re-ranked at launch (write_plan)
    chooses the layout parse chose, and plan.json records 2 (it once recorded the winner's 1
    and named another layout than the one that ran)."""
    cfg = make_config([*AUTO, "parallel.virtual_stages=2"], run_dir=tmp_path)
    assert cfg.parallel.fixed == ("parallel.virtual_stages=2",)
    doc = write_plan(cfg, accept=runnable_problems)
    p = cfg.parallel
    ran = f"dp{p.dp} tp{p.tp} pp{p.pp} v{p.virtual_stages} z{p.zero} {p.schedule}"
    assert doc["chosen"]["layout"].startswith(ran), (doc["chosen"]["layout"], ran)
    assert doc["fixed"] == {"parallel.virtual_stages": 2}

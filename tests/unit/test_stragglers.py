"""Straggler detection's pure parts: who is named, and issue times read from a flight-recorder
dump (the collective parts run in tests/integration/test_hang.py)."""

from __future__ import annotations

import json

import pytest

from hpctrain.distributed import stragglers
from tests.conftest import make_config


def test_the_rank_over_the_median_by_the_threshold_is_named():
    assert stragglers.named([1.0, 1.0, 1.25, 1.0], 0.2) == [2]
    assert stragglers.named([1.0, 1.0, 1.15, 1.0], 0.2) == []
    assert stragglers.named([3.5, 2.0], 0.2) == [0]  # two ranks: the median is their mean
    assert stragglers.named([3.1, 2.5], 0.2) == []  # (so 3.1 vs 2.5 is within 20% of it)
    assert stragglers.named([2.0], 0.2) == []


def test_issue_times_per_group_leave_out_point_to_point_and_other_groups():
    entries = [
        {"process_group": ["0", "default_pg"], "collective_seq_id": 2, "is_p2p": False,
         "time_created_ns": 20},
        {"process_group": ["0", "default_pg"], "collective_seq_id": 1, "is_p2p": False,
         "time_created_ns": 10},
        {"process_group": ["3", "pp"], "collective_seq_id": 0, "is_p2p": True,
         "time_created_ns": 15},
        {"process_group": ["5", "tp"], "collective_seq_id": 7, "is_p2p": False,
         "time_created_ns": 30},
    ]
    trace = json.dumps({"entries": entries}).encode()
    got = stragglers.issue_times(trace, {"0", "3"})
    assert got == {"0": [(1, 10), (2, 20)], "3": []}
    assert stragglers.issue_times(None, {"0"}) == {"0": []}


def test_recorded_hosts_accumulate(tmp_path):
    assert stragglers.excluded(tmp_path) == []
    stragglers.record(tmp_path, ["n3"])
    stragglers.record(tmp_path, ["n1", "n3"])
    assert stragglers.excluded(tmp_path) == ["n1", "n3"]


@pytest.mark.parametrize("override, said", [
    ("cluster.straggler_window=-1", "must be ≥ 0"),
    ("cluster.straggler_threshold=0", "must be > 0"),
    ("cluster.exclude_stragglers=maybe", "should be bool"),
])
def test_bad_straggler_keys_are_refused_naming_the_fix(override, said):
    with pytest.raises(ValueError, match=said):
        make_config([override])

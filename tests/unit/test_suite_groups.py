"""The suite's xdist groups reach the scheduler: under `--dist loadgroup` (tests/run.sh) each
test's node id carries its group (tests/conftest.py), so a file's tests run on one worker, in
order, sharing its module fixtures (the README commands build on each other). pytest 9.2 moved
node ids where xdist 3.8 cannot suffix them, which scattered every file silently: pinned below
9.2 in the dev extra, and this test says so if grouping stops working."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT


def test_xdist_groups_reach_the_scheduler(request):
    if not getattr(request.config.option, "loadgroup", False):  # set on xdist workers
        pytest.skip("not run under pytest-xdist --dist loadgroup")
    group = str(request.node.path.relative_to(ROOT))
    assert request.node.nodeid.endswith(f"@{group}"), (
        f"{request.node.nodeid} carries no xdist group: this pytest/xdist pair does not group "
        "tests (pytest 9.2 with xdist 3.8 does not): install the dev extra's versions")

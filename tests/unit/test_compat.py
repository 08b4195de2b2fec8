"""The composition matrix (hpctrain.tasks.compat): generated from the validation rules, equal to the
README's copy, and its cells what those rules say."""

from __future__ import annotations

import pytest

from hpctrain.tasks import compat
from hpctrain.tasks.compat import run_compat
from tests.conftest import ROOT, make_config


def test_readme_table_is_the_task_output(tmp_path):
    result = run_compat(make_config(["task=compat"], run_dir=tmp_path))
    assert (tmp_path / "compat.md").read_text(encoding="utf-8") == result["text"] + "\n"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert compat.readme_section(readme) == result["text"], (
        "README's composition matrix is stale: paste the output of "
        "`python -m hpctrain task=compat` between the compat markers")


def test_readme_section_needs_its_markers():
    with pytest.raises(ValueError, match="compat:begin"):
        compat.readme_section("# no table here\n")


@pytest.mark.parametrize("pair, expected", [
    (("z3", "1f1b"), "parallel.zero=3 with parallel.pp=2 is refused"),
    (("cp", "ep"), ()),
    (("sp", "ep"), ()),
    (("tp", "sp"), ()),
    (("z1", "z2"), None),  # one key, two values: alternatives
    (("gpipe", "zbv"), None),
    (("dp", "hsdp"), ()),  # dp takes the larger degree: HSDP's 4
])
def test_cells_follow_the_validation_rules(pair, expected):
    got = compat.refusals(pair)
    if isinstance(expected, str):
        assert got and got[0].startswith(expected), got
    else:
        assert got == expected


def test_a_pair_gets_the_ranks_of_its_layout():
    assert compat.ranks(compat.combine(("hsdp", "tp"))) == 8
    assert compat.ranks(compat.combine(("dp", "z1"))) == 2
    assert "cluster.procs_per_node=4" in compat.overrides(("tp", "cp"))


def test_bf16_runs_count_only_their_own_pairs():
    run = ("tp", "cp", "fp8")
    assert compat._covers(run) == {("tp", "fp8"), ("cp", "fp8")}
    assert compat._covers(("tp", "cp")) == {("tp", "cp")}


def test_covering_runs_cover_every_accepted_pair_within_8_ranks():
    covered = set()
    for run in compat.covering_runs():
        assert compat.refusals(run) == () and compat.ranks(compat.combine(run)) <= 8, run
        covered |= compat._covers(run)
    assert covered == set(compat.accepted_pairs())

"""Slurm hostlists: the parser expands every form Slurm documents, `expand_nodelist` asks
`scontrol show hostnames` when it can and falls back to the parser when it cannot, and the two
agree where a Slurm client is installed."""

from __future__ import annotations

import logging
import shutil
import subprocess

import pytest

from hpctrain.distributed.env import expand_nodelist, first_host, parse_nodelist

FORMS = {
    "n1": ["n1"],
    "n[1-3]": ["n1", "n2", "n3"],
    "n[01-03,7]": ["n01", "n02", "n03", "n7"],
    "n[8-10]": ["n8", "n9", "n10"],
    "node-[001-002]-ib": ["node-001-ib", "node-002-ib"],
    "a[01-02]b[1-2]": ["a01b1", "a01b2", "a02b1", "a02b2"],
    "lx[10-11],gpu[1-2]": ["lx10", "lx11", "gpu1", "gpu2"],
    "tux[1,3-4]-ib,other": ["tux1-ib", "tux3-ib", "tux4-ib", "other"],
    "n[1-3,7],gpu[08-09],login": ["n1", "n2", "n3", "n7", "gpu08", "gpu09", "login"],
}


@pytest.mark.parametrize("nodelist", FORMS)
def test_parser_expands_slurm_forms(nodelist):
    assert parse_nodelist(nodelist) == FORMS[nodelist]


@pytest.mark.parametrize("nodelist", ["n[1-3", "n1-3]", "n[[1-2]]", "n[3-1]", "n[a-b]", "n[]"])
def test_parser_refuses_malformed_lists(nodelist):
    with pytest.raises(ValueError, match="hostlist"):
        parse_nodelist(nodelist)


def _fake_scontrol(directory, script: str) -> None:
    path = directory / "scontrol"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


def test_expand_uses_scontrol_and_falls_back_to_the_parser(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: the parser
    assert expand_nodelist("node-[001-002]-ib") == ["node-001-ib", "node-002-ib"]
    _fake_scontrol(tmp_path, 'echo "$3-from-scontrol"')  # scontrol's answer wins
    assert first_host("n[1-2]") == "n[1-2]-from-scontrol"
    _fake_scontrol(tmp_path, "echo broken >&2; exit 1")  # a failing client: the parser, logged
    with caplog.at_level(logging.WARNING, logger="hpctrain.distributed.env"):
        assert expand_nodelist("a[01-02]b[1-2]") == FORMS["a[01-02]b[1-2]"]
    assert "scontrol show hostnames 'a[01-02]b[1-2]' failed" in caplog.text


def _scontrol_usable() -> str | None:
    """Why the real scontrol cannot be asked here, or None if it can."""
    if not shutil.which("scontrol"):
        return "no scontrol on PATH (Slurm's client is installed by slurm/local/start.sh)"
    proc = subprocess.run(["scontrol", "show", "hostnames", "n[1-2]"], capture_output=True,
                          text=True, timeout=10)
    if proc.returncode or proc.stdout.split() != ["n1", "n2"]:
        return f"scontrol show hostnames does not work here: {proc.stderr.strip()[-200:]}"
    return None


def test_scontrol_agrees_with_the_parser(tmp_path, monkeypatch):
    """Without a running controller scontrol still needs a slurm.conf: a minimal one. Slurm
    22.05's scontrol refuses text after the last bracket ('node-[001-002]-ib', which it would
    itself write as 'node-001-ib,node-002-ib'): there expand_nodelist falls back to the parser."""
    (tmp_path / "slurm.conf").write_text("ClusterName=t\nSlurmctldHost=localhost\n"
                                         "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    if reason := _scontrol_usable():
        pytest.skip(reason)
    accepted = []
    for nodelist, hosts in FORMS.items():
        proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                              text=True, timeout=10)
        if proc.returncode == 0 and proc.stdout.split():  # a refused list: exit 0, no host
            assert proc.stdout.split() == hosts == parse_nodelist(nodelist), nodelist
            accepted.append(nodelist)
        assert expand_nodelist(nodelist) == hosts, nodelist
    assert {"n[01-03,7]", "a[01-02]b[1-2]", "lx[10-11],gpu[1-2]"} <= set(accepted)

"""Who am I? Rank, local rank and world size from torchrun or Slurm variables.

torchrun sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. Inside a Slurm task (one task
per rank, no torchrun) we read SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, take the first host of
the allocation as the master and derive the port from the job id, so every task agrees without
talking to each other.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)
SCONTROL_TIMEOUT_S = 10  # it only expands a string, but a hung Slurm client must not hang startup


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # torchrun | slurm | single


# Below Linux's default ephemeral range (ip_local_port_range 32768-60999): a port in that range
# may already be the local end of some other process's outgoing connection (it happened: a sweep
# point's rank 0 met EADDRINUSE on 33001 and its peer waited out cluster.timeout_s).
PORT_BASE, PORT_SPAN = 10000, 22000


def slurm_port(job_id: str) -> int:
    """A port in [10000, 32000) that all tasks of one job derive identically from its id
    (SLURM_JOB_ID, which Slurm gives each array task on its own), so concurrent jobs whose
    masters share a node use different ports unless their ids are 22000 apart."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """Every hostname of a Slurm hostlist, in Slurm's order: `scontrol show hostnames` where
    scontrol is on PATH (Slurm's own reading), `parse_nodelist` otherwise or if it fails."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, check=True, timeout=SCONTROL_TIMEOUT_S).stdout
            if out.split():
                return out.split()
            log.warning("scontrol show hostnames %r printed no host: parsing it here", nodelist)
        except (OSError, subprocess.SubprocessError) as e:
            why = (getattr(e, "stderr", None) or str(e)).strip()
            log.warning("scontrol show hostnames %r failed (%s): parsing it here", nodelist, why)
    return parse_nodelist(nodelist)


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist without Slurm. Commas outside brackets separate hosts; a bracket
    holds comma-separated numbers and lo-hi ranges, zero-padded to the width of lo; text may
    follow a bracket, and several brackets in one name give their cartesian product, the first
    varying slowest: 'a[01-02]b[1-2],node-[7,9]-ib' → a01b1 a01b2 a02b1 a02b2 node-7-ib node-9-ib.
    """
    return [host for name in _split_names(nodelist) for host in _expand_name(name, nodelist)]


def _split_names(nodelist: str) -> list[str]:
    """Split at the commas outside brackets; refuse unbalanced or nested brackets."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"hostlist {nodelist!r} has nested or unmatched brackets at "
                             f"character {i}: write it as Slurm does, e.g. 'n[1-3,7],gpu[08-09]'")
        if ch == "," and depth == 0:
            names.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {nodelist!r} has an unclosed '[': close it with ']'")
    names.append(nodelist[start:])
    return [n.strip() for n in names if n.strip()]


def _expand_name(name: str, nodelist: str) -> list[str]:
    """One name with zero or more bracket groups → its hosts (first group varies slowest)."""
    head, bracket, rest = name.partition("[")
    if not bracket:
        return [name]
    ranges, _, tail = rest.partition("]")
    return [f"{head}{number}{suffix}" for number in _numbers(ranges, nodelist)
            for suffix in _expand_name(tail, nodelist)]


def _numbers(ranges: str, nodelist: str) -> list[str]:
    """'01-03,7' → 01 02 03 7: each lo-hi range zero-padded to the width of lo."""
    out = []
    for part in ranges.split(","):
        lo, dash, hi = part.strip().partition("-")
        hi = hi if dash else lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"hostlist {nodelist!r}: [{ranges}] holds {part!r}, not a number "
                             "or an increasing range lo-hi: use e.g. [01-04,7]")
        out += [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
    return out


def first_host(nodelist: str) -> str:
    """First hostname of the allocation: the rendezvous master for every task."""
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts[0]


def from_environ(environ: Mapping[str, str] | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                       env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                       "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return DistEnv(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)),
                       int(env["SLURM_NTASKS"]), first_host(env["SLURM_JOB_NODELIST"]),
                       slurm_port(env["SLURM_JOB_ID"]), "slurm")
    return DistEnv(0, 0, 1, "127.0.0.1", 29500, "single")

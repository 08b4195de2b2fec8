"""Who am I? Rank, local rank and world size from torchrun or Slurm variables.

torchrun sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. Inside a Slurm task (one task
per rank, no torchrun) we read SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, take the first host of
the allocation as the master and derive the port from the job id, so every task agrees without
talking to each other.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str  # torchrun | slurm | single


def slurm_port(job_id: str) -> int:
    """A port in [20000, 40000) that all tasks of one job derive identically."""
    return 20000 + int(job_id) % 20000


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist: 'n[1-3,7],gpu[08-09]' → n1 n2 n3 n7 gpu08 gpu09."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}")
    return hosts


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
        job_id = env.get("SLURM_ARRAY_JOB_ID", env["SLURM_JOB_ID"])
        if "SLURM_ARRAY_TASK_ID" in env:
            job_id = str(int(job_id) * 1000 + int(env["SLURM_ARRAY_TASK_ID"]))
        return DistEnv(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)),
                       int(env["SLURM_NTASKS"]), first_host(env["SLURM_JOB_NODELIST"]),
                       slurm_port(job_id), "slurm")
    return DistEnv(0, 0, 1, "127.0.0.1", 29500, "single")

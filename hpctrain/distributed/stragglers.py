"""Stragglers named while training: the rank the others wait for, every `window` steps.

A rank that is slow but not stopped holds every collective it takes part in: its peers arrive
first and wait. torch's flight recorder (on in every launched rank, `launch.worker`) notes when
each rank issued each collective of each group (`time_created_ns`). At a step boundary every
member of a group has issued the same collectives, so, every cluster.straggler_window steps:

1. per group this rank belongs to (every group of the mesh, in one global order: no cycle of
   waits), the members agree on how many of the window's collectives all of them still hold
   (an all-reduce MIN), then take the latest issue time of each (an all-reduce MAX over
   int64 nanoseconds); this rank waited `latest - its own` at each;
2. compute time = the window's wall time - the waits (the time the rank spent on its own
   work), collected from every rank (an all-gather of two numbers);
3. a rank whose compute time exceeds the median by more than cluster.straggler_threshold
   (a fraction) for the window is a straggler: the logging rank names it with its host (log,
   metrics, a W&B alert), and with cluster.exclude_stragglers it is excluded at the next
   restart (`record`, read by `hpctrain.launch.requeue`).

A window costs two small collectives per group and one on the world, and one flight-recorder
dump per rank (milliseconds). Clocks: issue times of ranks on different hosts compare across
their clocks, which NTP keeps within a millisecond: far below a straggler's excess.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.distributed.rundir import work_dir

FILE = "stragglers.json"


def named(compute_s: list[float], threshold: float) -> list[int]:
    """Ranks whose compute time exceeds the median by more than `threshold` (a fraction)."""
    if len(compute_s) < 2:
        return []
    median = statistics.median(compute_s)
    return [r for r, c in enumerate(compute_s) if c > median * (1 + threshold)]


def issue_times(trace: bytes | None, group_names: set[str]) -> dict[str, list[tuple[int, int]]]:
    """Group name → (sequence number, issue time in ns) of this rank's collectives in it,
    oldest first, from a flight-recorder dump (point-to-point operations left out: their
    peers differ)."""
    out: dict[str, list[tuple[int, int]]] = {name: [] for name in group_names}
    for entry in json.loads(trace).get("entries", []) if trace else []:
        name = entry.get("process_group", [None])[0]
        if name in out and not entry.get("is_p2p"):
            out[name].append((int(entry["collective_seq_id"]), int(entry["time_created_ns"])))
    return {name: sorted(found) for name, found in out.items()}


@dataclass
class Window:
    """One rank's straggler detector (module doc): `check` at a step boundary, on every rank."""

    groups: list[dist.ProcessGroup]  # every group of the mesh this rank is in, ordered
    world: dist.ProcessGroup
    device: torch.device
    last_seq: dict[str, int] | None = None  # per group: the last collective already counted
    since: float = 0.0

    @classmethod
    def of(cls, groups, *, world: dist.ProcessGroup, device: torch.device) -> Window:
        unique = {g.group_name: g for g in groups if g is not None and g.size() > 1}
        return cls([unique[name] for name in sorted(unique)], world, device,
                   since=time.monotonic())

    def check(self, trace: bytes | None) -> tuple[list[float], list[float]] | None:
        """Collective over this rank's groups and the world: every rank's compute and wait
        seconds since the last check (None at the first, which only starts the window)."""
        now = time.monotonic()
        times = issue_times(trace, {g.group_name for g in self.groups})
        first, last = self.last_seq is None, dict(self.last_seq or {})
        waited, counted = 0.0, {}
        for group in self.groups:
            name = group.group_name
            new = [t for seq, t in times[name] if seq > last.get(name, -1)] if not first else []
            # members issued the same ones; the recorder may have dropped a few old ones
            k = _reduced([len(new)], dist.ReduceOp.MIN, group, self.device)[0]
            issued = 1
            if k:
                own = torch.tensor(new[-k:], dtype=torch.int64, device=self.device)
                latest = own.clone()
                dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=group)
                waited += float((latest - own).sum()) / 1e9
                issued += 1
            top = times[name][-1][0] if times[name] else last.get(name, 0)
            counted[name] = top + issued  # this check's own collectives: counted next time
        pair = torch.tensor([max(now - self.since - waited, 0.0), waited], dtype=torch.float64,
                            device=self.device)
        every = [torch.empty_like(pair) for _ in range(self.world.size())]
        dist.all_gather(every, pair, group=self.world)
        if self.world.group_name in counted:
            counted[self.world.group_name] += 1
        self.last_seq, self.since = counted, time.monotonic()
        if first:
            return None
        return [float(p[0]) for p in every], [float(p[1]) for p in every]


def _reduced(values: list[int], op, group, device) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return [int(v) for v in t.tolist()]


def record(run_dir: Path | str, hosts: list[str]) -> None:
    """Hosts of named stragglers, for the next restart to exclude (cluster.exclude_stragglers)."""
    path = work_dir(run_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    known = set(excluded(run_dir))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sorted(known | set(hosts))))
    os.replace(tmp, path)


def excluded(run_dir: Path | str) -> list[str]:
    try:
        return list(json.loads((work_dir(run_dir) / FILE).read_text()))
    except (OSError, ValueError):
        return []

"""A run's restarts after faults: what ended each job, the nodes it left out, what it cost.

Two files in the run directory, so every later start of the run reads them:

- `.hpctrain/fault.json`: the fault that ended the job now being requeued, written by the rank
  that claimed the hang report just before it requeues (`hpctrain.launch.requeue`): time,
  cause, nodes, the step reached, the world and layout it ran.
- `restarts.jsonl`: one record per restart, appended by the logging rank of the next start
  once it has resumed (`complete`): time, cause, nodes (excluded), resumed_step, steps_lost
  (the step reached less the step resumed), world_before, world_after, and the layouts.

Preemptions and time limits are not faults: they save first and requeue through
`hpctrain.distributed.preempt`, and are recorded nowhere here. The nodes of every record stay
excluded for the rest of the run (`excluded`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hpctrain.distributed.rundir import work_dir

Record = dict[str, Any]
RESTARTS = "restarts.jsonl"


def _fault_path(run_dir: Path | str) -> Path:
    return work_dir(run_dir) / "fault.json"


def record_fault(run_dir: Path | str, *, cause: str, nodes: list[str], step: int | None,
                 world: int, layout: str, job_id: str | None) -> Record:
    """Write the pending fault (atomically: a rank killed meanwhile leaves the old file)."""
    fault = {"time": time.time(), "cause": cause, "nodes": sorted(nodes), "step": step,
             "world_before": world, "layout_before": layout, "job_id": job_id}
    path = _fault_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fault))
    os.replace(tmp, path)
    return fault


def pending(run_dir: Path | str) -> Record | None:
    try:
        return json.loads(_fault_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


def history(run_dir: Path | str) -> list[Record]:
    """Every completed restart of the run, oldest first (unreadable lines skipped)."""
    try:
        lines = (Path(run_dir) / RESTARTS).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def faults(run_dir: Path | str) -> list[Record]:
    """The completed restarts and the pending fault: what counts against
    cluster.max_restarts."""
    found = pending(run_dir)
    return history(run_dir) + ([found] if found is not None else [])


def excluded(run_dir: Path | str) -> list[str]:
    """Every node a fault of this run named: left out of the rest of the run."""
    return sorted({n for r in faults(run_dir) for n in r.get("nodes", [])})


def complete(run_dir: Path | str, *, resumed_step: int, world: int, layout: str) -> Record | None:
    """The pending fault as a restart record, appended to restarts.jsonl (the pending file
    removed); None when this start follows no fault."""
    fault = pending(run_dir)
    if fault is None:
        return None
    reached = fault.get("step")
    record = {"time": fault["time"], "cause": fault["cause"], "nodes": fault["nodes"],
              "resumed_step": resumed_step,
              "steps_lost": None if reached is None else max(0, reached - resumed_step),
              "world_before": fault["world_before"], "world_after": world,
              "layout_before": fault["layout_before"], "layout_after": layout,
              "job_id": fault.get("job_id"), "restarted": time.time()}
    with (Path(run_dir) / RESTARTS).open("a") as f:
        f.write(json.dumps(record) + "\n")
    _fault_path(run_dir).unlink(missing_ok=True)
    return record


def describe(records: list[Record]) -> str:
    """One line per restart: when, why, which nodes, what it cost."""
    lines = []
    for i, r in enumerate(records, 1):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.get("time", 0)))
        nodes = ",".join(r.get("nodes", [])) or "no node"
        cost = (f", resumed at step {r['resumed_step']} ({r['steps_lost']} steps lost), world "
                f"{r['world_before']} -> {r['world_after']}" if "resumed_step" in r else
                f", in step {r.get('step')} (not resumed yet)")
        lines.append(f"  {i}. {when}: {r.get('cause')}; excluded {nodes}{cost}")
    return "\n".join(lines)

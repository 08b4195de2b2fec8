"""What each task leaves in its run dir, read back for the sweep summary.

Every task writes one result file; a point that wrote it finished. The summary shows a few
numbers of each (`RESULTS`): training's `summary.json` (status "incomplete" when it stopped
before its last step), `task=simulate`'s `simulation.json`, `task=plan`'s `plan.json` (the
configured layout's prediction and, after a search, the winner) and `task=bench`'s
`bench.json`. A run dir of a training point also holds a `plan.json` (written by the planner
before launch), so `summary.json` is looked for first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _train(doc: dict) -> dict[str, Any]:
    return {k: doc.get(k) for k in ("final_loss", "final_eval_loss", "completed_steps",
                                    "tokens_per_s")}


def _simulate(doc: dict) -> dict[str, Any]:
    return {"schedule": doc.get("schedule"), "bubble_rate": doc.get("bubble_rate"),
            "cost": doc.get("cost"), "peak_activations": max(doc.get("peak_activations") or [0])}


def _plan(doc: dict) -> dict[str, Any]:
    out = {"step_time_s": doc.get("step_time_s"), "mfu": doc.get("mfu"), "fits": doc.get("fits")}
    best = next((c for c in doc.get("search") or [] if c.get("reason") == "best"), None)
    if best is not None:
        out["best"] = f"{best['layout']} {best['recompute']}"
    return out


def _bench(doc: dict) -> dict[str, Any]:
    meta = doc.get("meta") or {}
    return {"bench": meta.get("name", meta.get("bench")), "records": len(doc.get("records", [])),
            "outliers": len(doc.get("outliers", []))}


# (task, file, reader) in the order they are looked for.
RESULTS = (("train", "summary.json", _train), ("simulate", "simulation.json", _simulate),
           ("bench", "bench.json", _bench), ("plan", "plan.json", _plan))


def read_result(run_dir: Path) -> tuple[str, str, dict[str, Any]] | None:
    """(task, status, numbers) of the point in `run_dir`, or None when no task finished there.
    status is "ok", or "incomplete" for a training run that stopped before its last step."""
    for task, name, reader in RESULTS:
        path = run_dir / name
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        if task == "train":
            done = doc.get("completed_steps", doc.get("steps")) == doc.get("steps")
            return task, "ok" if done else "incomplete", reader(doc)
        return task, "ok", reader(doc)
    return None

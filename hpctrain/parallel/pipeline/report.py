"""Summarise a simulated schedule as a dict (for JSONL/benchmarks) and a short text table."""

from __future__ import annotations

from typing import Any

from hpctrain.parallel.pipeline.actions import Schedule
from hpctrain.parallel.pipeline.simulate import SimResult


def simulation_report(
    schedule: Schedule, result: SimResult, *, costs: dict[str, float] | None = None
) -> dict[str, Any]:
    """Plain-data summary: schedule shape, costs given to the simulator, bubble and memory.

    `costs` (t_f, t_b, t_w, t_comm) is recorded as given; the simulator result does not keep it.
    """
    return {
        "schedule": schedule.name,
        "pp": schedule.n_ranks,
        "microbatches": schedule.n_microbatches,
        "virtual_stages": schedule.chunks,
        "stages": schedule.n_stages,
        "costs": dict(costs or {}),
        "cost": result.cost,
        "makespan": result.makespan,
        "work_per_rank": result.work_per_rank,
        "bubble_rate": result.bubble_rate,
        "makespan_bubble_rate": result.makespan_bubble_rate,
        "peak_activations": list(result.peak_activations),
    }


def format_table(report: dict[str, Any]) -> str:
    """Aligned two-column text table of a `simulation_report`."""
    costs = ", ".join(f"{k}={v:g}" for k, v in report["costs"].items()) or "-"
    rows = [
        ("schedule", str(report["schedule"])),
        ("pp × virtual stages", f"{report['pp']} × {report['virtual_stages']}"),
        ("microbatches", str(report["microbatches"])),
        ("costs", costs),
        ("cost (max rank span)", f"{report['cost']:.4f}"),
        ("makespan", f"{report['makespan']:.4f}"),
        ("bubble rate", f"{report['bubble_rate']:.4f}"),
        ("bubble rate (from t=0)", f"{report['makespan_bubble_rate']:.4f}"),
        ("peak activations", " ".join(str(x) for x in report["peak_activations"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)

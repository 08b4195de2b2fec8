"""The `plan` group (task=plan, parallel=auto, the pre-launch fit check): its keys, their
ranges, and the lists the layout search takes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpctrain.config.build import build
from hpctrain.config.schema import Config
from hpctrain.config.validate.keys import Range, fraction, positive, range_problems
from hpctrain.parallel.pipeline.schedules import SCHEDULES


@dataclass(frozen=True)
class PlanConfig:
    """The `plan` group (task=plan). Ranges: PLAN_RANGES; zero_stages and
    schedules (a registry) are checked by plan_setting_problems."""

    search: bool = False  # rank every valid layout of n_devices, not only the configured one
    n_devices: int | None = None  # devices to lay out when searching (None: nodes × procs)
    top: int = 5  # layouts listed by the search
    dp_overlap: float = 0.0  # fraction of dp gradient communication hidden behind backward
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)  # the search tries these ZeRO stages ...
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "zb_h1")  # ... and schedules
    # Typical document length (tokens) of rows packed with data.packing=documents: attention
    # FLOPs count min(it, seq_len) keys per token instead of seq_len. None: whole rows.
    document_tokens: int | None = None
    # Before a training run (hpctrain.plan.auto): a layout whose predicted peak bytes per rank
    # exceed (1 − headroom) × the device memory is refused, unless force. memory_limit_gb
    # (GiB) replaces the device table's memory; on a CPU without it nothing is refused.
    headroom: float = 0.1
    memory_limit_gb: float | None = None
    force: bool = False
    # A finished training run's dir: its measured step times refine its device's in-step GEMM
    # (and fused-attention) rate, achievable_fraction, reporting the step-time error before and
    # after; a plan for another device is refused; without cluster.accelerator its measured
    # device is the plan's (hpctrain.plan.calibrate_run)
    calibrate_from: str | None = None


def plan_settings(cfg: Config) -> PlanConfig:
    """The `plan` group of `cfg.extra` as a PlanConfig; ValueError naming every unknown (with
    a "did you mean") or mistyped key."""
    return build(PlanConfig, "plan", cfg.extra.get("plan") or {})


PLAN_RANGES: dict[str, Range] = {
    "plan.n_devices": positive("or null for nodes × procs_per_node"),
    "plan.top": positive(),
    "plan.dp_overlap": fraction(fix="the fraction of dp communication hidden: e.g. 0.0"),
    "plan.document_tokens": positive("or null for whole rows"),
    "plan.headroom": Range(lo=0.0, hi=1.0, hi_open=True, fix="e.g. plan.headroom=0.1"),
    "plan.memory_limit_gb": positive("GiB per rank, or null for the device's memory"),
}


def plan_setting_problems(c: Config) -> list[str]:
    """The plan.* settings' problems (keys, ranges, lists): task=plan, and what parallel=auto
    and the pre-launch fit check read."""
    try:
        settings = plan_settings(c)
    except ValueError as err:
        return [str(err)]
    given = {**dataclasses.asdict(settings), **(c.extra.get("plan") or {})}  # as the user wrote
    values = {f"plan.{key}": value for key, value in given.items()}
    errs = [p.text for p in range_problems(values, PLAN_RANGES)]
    for key, allowed in (("zero_stages", (0, 1, 2, 3)), ("schedules", tuple(SCHEDULES))):
        bad = [v for v in getattr(settings, key) if v not in allowed]
        if bad:
            errs.append(f"plan.{key} has {bad}: choose from {', '.join(map(str, allowed))}")
    return errs

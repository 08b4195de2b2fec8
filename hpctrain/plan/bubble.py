"""Pipeline idle time and activations in flight, read off the simulator of the exact schedule.

The planner has no closed forms of its own: `bubble_fraction` and `in_flight_microbatches`
build the named schedule (`hpctrain.parallel.pipeline.schedules`) for (p, m, v) and time it
with `hpctrain.parallel.pipeline.simulate.simulate`, the same simulator `task=simulate` and the
pipeline runtime's tests use, so the planner cannot drift from the schedules that run.

Symbols: p pipeline ranks, m microbatches, v model chunks per rank, T_F/T_B/T_W the per-chunk
forward, input-gradient and weight-gradient times (B excludes W; schedules without a W split
run B+W as one action), T_comm the seconds of one stage-to-stage hop.

Bubble rate (Qi et al. 2024, the simulator's definition): (cost − work) / cost, cost the longest
busy span over ranks, work = m·v·(T_F+T_B+T_W). A 1F1B-family schedule with m < p cannot fill
its warm-up; the generators still produce it (it degenerates to GPipe's order) and it is timed
as generated. Results are cached on (schedule, p, m, v) and the cost ratios (4 significant
digits) because the search asks for the same pipelines many times.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from hpctrain.parallel.pipeline.actions import ActionKind
from hpctrain.parallel.pipeline.schedules import SCHEDULES as BUILDERS
from hpctrain.parallel.pipeline.schedules import interleaved_1f1b
from hpctrain.parallel.pipeline.simulate import check, simulate
from hpctrain.plan.layout import SCHEDULES


def _check(schedule: str, pp: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; choose one of {SCHEDULES}")
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"pp={pp}, m={m}, v={v} must all be >= 1")


@lru_cache(maxsize=1024)
def _built(schedule: str, pp: int, m: int, v: int):
    """The schedule, built and checked once (a search times it under many costs)."""
    built = interleaved_1f1b(pp, m, v) if schedule == "interleaved_1f1b" else BUILDERS[
        schedule](pp, m)
    check(built)
    return built


@lru_cache(maxsize=8192)
def _simulated(schedule: str, pp: int, m: int, v: int, costs: tuple[float, ...]):
    """(bubble rate, peak activation sets per rank) of the built schedule."""
    built = _built(schedule, pp, m, v)
    t_f, t_b, t_w, t_comm = costs
    sim = simulate(built, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm, checked=True)
    return sim.bubble_rate, tuple(sim.peak_activations)


def _ratios(t_f: float, t_b: float, t_w: float, t_comm: float) -> tuple[float, ...]:
    """Costs scaled to T_F = 1 and rounded: the bubble rate depends only on the ratios."""
    if t_f <= 0 or t_b < 0 or t_w < 0 or t_comm < 0:
        raise ValueError(f"costs t_f={t_f} (> 0), t_b={t_b}, t_w={t_w}, t_comm={t_comm} "
                         "(>= 0) are seconds per chunk and microbatch")
    return tuple(float(f"{x / t_f:.4g}") for x in (t_f, t_b, t_w, t_comm))


def bubble_fraction(
    schedule: str,
    *,
    pp: int,
    m: int,
    v: int = 1,
    t_f: float = 1.0,
    t_b: float = 1.0,
    t_w: float = 1.0,
    t_comm: float = 0.0,
) -> float:
    """Idle fraction of a step, (cost − work)/cost, simulated for the exact schedule (module
    docstring). pp = 1 has no pipeline: 0."""
    _check(schedule, pp, m, v)
    if pp == 1:
        return 0.0
    return _simulated(schedule, pp, m, v, _ratios(t_f, t_b, t_w, t_comm))[0]


def in_flight_microbatches(schedule: str, *, pp: int, m: int, v: int = 1) -> int:
    """Peak (microbatch, chunk) activation sets alive on the busiest rank, from the simulator.

    One set = the activations of n_layers/(pp·v) layers for one microbatch, so memory is
    in_flight × that (`hpctrain.plan.memory.formulas`). pp = 1 keeps one microbatch at a time.
    """
    return max(in_flight_by_rank(schedule, pp=pp, m=m, v=v))


def in_flight_by_rank(schedule: str, *, pp: int, m: int, v: int = 1) -> tuple[int, ...]:
    """Peak (microbatch, chunk) activation sets alive on each pipeline rank (first to last)."""
    _check(schedule, pp, m, v)
    if pp == 1:
        return (1,)
    return _simulated(schedule, pp, m, v, (1.0, 1.0, 1.0, 0.0))[1]


@lru_cache(maxsize=1024)
def _live_events(schedule: str, pp: int, m: int, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per pipeline rank, its forward (+1) and input-gradient (−1) actions in order, with
    their stage: a (microbatch, stage) set lives from its F to its B (or BW)."""
    F, B, BW = ActionKind.F, ActionKind.B, ActionKind.BW
    return tuple(tuple((1 if a.kind is F else -1, a.stage) for a in acts if a.kind in (F, B, BW))
                 for acts in _built(schedule, pp, m, v).actions)


def weighted_peaks(schedule: str, stage_bytes: Callable[[int], float], *, pp: int, m: int,
                   v: int = 1, backward_extra: Callable[[int], float] | None = None
                   ) -> tuple[float, ...]:
    """Per pipeline rank, the peak over its actions in order of Σ stage_bytes(s) of the
    (microbatch, stage s) sets alive: `in_flight_by_rank` with each set weighed, so what only
    one stage keeps (the head's log-softmax on the last, the token ids on the first) counts
    exactly while that stage's own sets are alive. `backward_extra(s)`: what a set's backward
    holds beyond the live sets while it runs (full recomputation: the block rerun, less what
    that backward freed first), a candidate peak at each backward. pp = 1: one set of
    stage 0."""
    _check(schedule, pp, m, v)
    extra = backward_extra or (lambda _stage: 0.0)
    if pp == 1:
        return (stage_bytes(0) + max(0.0, extra(0)),)
    peaks = []
    for events in _live_events(schedule, pp, m, v):
        live = peak = 0.0
        for sign, stage in events:
            if sign < 0:
                peak = max(peak, live + extra(stage))
            live += sign * stage_bytes(stage)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)

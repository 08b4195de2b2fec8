"""Check and simulate a pipeline schedule under per-stage costs.

Dependencies (n = n_stages, i = microbatch):
  F(s, i)      needs F(s-1, i)                       (nothing for s = 0)
  B/BW(s, i)   needs F(s, i) and B/BW(s+1, i)         (the last stage needs only its own F)
  W(s, i)      needs B(s, i)
Each rank runs its list in order. An action starts at max(rank free, finish of each dependency
+ t_comm if that dependency ran on another rank) and lasts t_f, t_b, t_w, or t_b + t_w for BW.
Communication actions added by lowering are skipped here (their cost is the t_comm per hop).

Bubble rate (Qi et al. 2024): (cost − work) / cost with work = chunks · m · (t_f + t_b + t_w),
the useful time of one rank, and cost = the largest execution time over ranks, where a rank's
execution time runs from the start of its first action to the finish of its last (a rank
starts when its first input arrives). This reproduces every column of the paper's Table 5,
including ZB-H2's (p−1)(T_F+T_B−2T_W) + 2(p−1)T_comm, and gives ZB-V exactly 0 with equal
costs. `makespan` (latest finish, measured from t = 0) and `makespan_bubble_rate` =
(makespan − work) / makespan are also reported: they agree with the above for gpipe, 1F1B and
ZB-H1 (rank 0 starts at 0 and finishes last), but charge the start-up ramp of the last rank
((p−1)(T_F+T_comm)) to ZB-H2 and ZB-V.

Peak activations: per rank, in units of one stage-microbatch's stored activations, walking the
rank's list in order: +1 at each F, −1 when the input-gradient part of its backward (B or BW)
is done; W is assumed to need only the small part of the activations kept for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hpctrain.parallel.pipeline.actions import Action, ActionKind, Schedule

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW
Key = tuple[int, str, int]  # (stage, "F" | "B" | "W", microbatch); BW completes "B" and "W"


@dataclass(frozen=True)
class SimResult:
    cost: float  # max over ranks of (last finish − first start)
    bubble_rate: float  # (cost − work_per_rank) / cost
    makespan: float  # latest finish, from t = 0
    makespan_bubble_rate: float  # (makespan − work_per_rank) / makespan
    work_per_rank: float
    timeline: tuple[tuple[tuple[float, float, Action], ...], ...]  # per rank (start, end, action)
    peak_activations: tuple[int, ...]

    def boxes(self) -> list[list[tuple[float, float, str, str]]]:
        """Per rank (start, end, label, kind) tuples, the input of `timeline.draw_timeline`."""
        return [
            [(t0, t1, str(a.microbatch), a.kind.value) for t0, t1, a in rank]
            for rank in self.timeline
        ]


def dependencies(action: Action, *, n_stages: int) -> list[Key]:
    """The completion keys `action` waits for (see the module docstring)."""
    s, i = action.stage, action.microbatch
    if action.kind is F:
        return [(s - 1, "F", i)] if s > 0 else []
    if action.kind in (B, BW):
        deps: list[Key] = [(s, "F", i)]
        if s < n_stages - 1:
            deps.append((s + 1, "B", i))
        return deps
    if action.kind is W:
        return [(s, "B", i)]
    raise ValueError(f"{action}: communication actions have no compute dependencies")


def _completes(action: Action) -> list[Key]:
    s, i = action.stage, action.microbatch
    if action.kind is BW:
        return [(s, "B", i), (s, "W", i)]
    return [(s, action.kind.value, i)]


def _check_complete(schedule: Schedule) -> None:
    """Every (stage, microbatch) has one F and either one BW or one B and one W, on its rank."""
    seen: Counter[Key] = Counter()
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if not a.kind.is_compute:
                continue
            in_range = 0 <= a.microbatch < schedule.n_microbatches
            if not (0 <= a.stage < schedule.n_stages and in_range):
                raise ValueError(f"{schedule.name}: {a} on rank {rank} is out of range")
            if schedule.stage_to_rank[a.stage] != rank:
                raise ValueError(
                    f"{schedule.name}: {a} is on rank {rank} but stage {a.stage} lives on rank "
                    f"{schedule.stage_to_rank[a.stage]}: move it to that rank's list"
                )
            seen.update(_completes(a))
    for s in range(schedule.n_stages):
        for i in range(schedule.n_microbatches):
            for kind in ("F", "B", "W"):
                if seen[s, kind, i] != 1:
                    state = "missing" if seen[s, kind, i] == 0 else "duplicated"
                    raise ValueError(f"{schedule.name}: {s}{kind}{i} is {state}")


def timelines(schedule: Schedule, duration: Callable[[int, Action], float],
              t_comm: float = 0.0) -> list[list[tuple[float, float, Action]]]:
    """Execute every rank's list in order under the dependency rules, compute action `a` of
    rank r lasting `duration(r, a)` (the nominal costs, or a step's measured durations to
    replay it); raise ValueError on deadlock. Per rank, its (start, end, action) tuples."""
    lists = [[a for a in acts if a.kind.is_compute] for acts in schedule.actions]
    done: dict[Key, tuple[float, int]] = {}  # key → (finish time, rank)
    free = [0.0] * schedule.n_ranks
    ptr = [0] * schedule.n_ranks
    timeline: list[list] = [[] for _ in lists]
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(lists):
            while ptr[rank] < len(acts):
                a = acts[ptr[rank]]
                deps = dependencies(a, n_stages=schedule.n_stages)
                if any(d not in done for d in deps):
                    break
                start = max([free[rank]] + [
                    done[d][0] + (t_comm if done[d][1] != rank else 0.0) for d in deps
                ])
                end = start + duration(rank, a)
                done.update({k: (end, rank) for k in _completes(a)})
                timeline[rank].append((start, end, a))
                free[rank], ptr[rank], progress = end, ptr[rank] + 1, True
    stuck = {r: str(acts[ptr[r]]) for r, acts in enumerate(lists) if ptr[r] < len(acts)}
    if stuck:
        raise ValueError(
            f"{schedule.name}: deadlock, ranks blocked at {stuck}: reorder so each action's "
            f"dependencies come earlier"
        )
    return timeline


def check(schedule: Schedule) -> None:
    """Raise ValueError if an action is missing, duplicated or misplaced, or if it deadlocks."""
    _check_complete(schedule)
    unit = {F: 1.0, B: 1.0, W: 1.0, BW: 2.0}
    timelines(schedule, lambda _rank, a: unit[a.kind])


def _peak_activations(acts: list) -> int:
    live = peak = 0
    for _, _, a in acts:
        live += 1 if a.kind is F else -1 if a.kind in (B, BW) else 0
        peak = max(peak, live)
    return peak


def simulate(
    schedule: Schedule, *, t_f: float, t_b: float, t_w: float, t_comm: float = 0.0,
    checked: bool = False,
) -> SimResult:
    """Check (unless `checked`: it passed `check` already), then time the schedule with
    per-stage costs (see the module docstring)."""
    if not checked:
        _check_complete(schedule)
    cost = {F: t_f, B: t_b, W: t_w, BW: t_b + t_w}
    timeline = timelines(schedule, lambda _rank, a: cost[a.kind], t_comm)
    makespan = max((acts[-1][1] for acts in timeline if acts), default=0.0)
    cost = max((acts[-1][1] - acts[0][0] for acts in timeline if acts), default=0.0)
    work = schedule.chunks * schedule.n_microbatches * (t_f + t_b + t_w)
    return SimResult(
        cost=cost,
        bubble_rate=(cost - work) / cost if cost > 0 else 0.0,
        makespan=makespan,
        makespan_bubble_rate=(makespan - work) / makespan if makespan > 0 else 0.0,
        work_per_rank=work,
        timeline=tuple(tuple(acts) for acts in timeline),
        peak_activations=tuple(_peak_activations(acts) for acts in timeline),
    )

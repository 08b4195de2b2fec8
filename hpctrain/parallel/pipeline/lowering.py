"""Lower a compute schedule to one with explicit point-to-point communication actions.

For an action on rank r (placement from `stage_to_rank`):
  F(s, i):     RECV_F(s, i) before it if stage s-1 is on another rank;
               SEND_F(s, i) after it if stage s+1 is on another rank.
  B/BW(s, i):  RECV_B(s, i) before it if stage s+1 is on another rank;
               SEND_B(s, i) after it if stage s-1 is on another rank.
SEND_F(s, i) pairs with RECV_F(s+1, i) and SEND_B(s, i) with RECV_B(s-1, i). A runtime with a
blocking recv and a non-blocking (buffered) send interprets the lowered list in order; since the
compute order is unchanged and each recv only waits for a dependency, a schedule that passes
`simulate.check` stays deadlock-free (`execute_lowered` verifies it by event simulation).
"""

from __future__ import annotations

from dataclasses import replace

from hpctrain.parallel.pipeline.actions import Action, ActionKind, Schedule
from hpctrain.parallel.pipeline.simulate import dependencies

K = ActionKind


def _lower_action(a: Action, schedule: Schedule, rank: int) -> list[Action]:
    s, i, last = a.stage, a.microbatch, schedule.n_stages - 1
    remote = {
        d: 0 <= s + d <= last and schedule.stage_to_rank[s + d] != rank for d in (-1, 1)
    }
    out = [a]
    if a.kind is K.F:
        if remote[-1]:
            out.insert(0, Action(s, K.RECV_F, i))
        if remote[1]:
            out.append(Action(s, K.SEND_F, i))
    elif a.kind in (K.B, K.BW):
        if remote[1]:
            out.insert(0, Action(s, K.RECV_B, i))
        if remote[-1]:
            out.append(Action(s, K.SEND_B, i))
    return out


def lower_comm(schedule: Schedule) -> Schedule:
    """The same schedule with SEND_*/RECV_* actions around cross-rank F and B/BW."""
    actions = tuple(
        tuple(x for a in acts if a.kind.is_compute for x in _lower_action(a, schedule, rank))
        for rank, acts in enumerate(schedule.actions)
    )
    return replace(schedule, actions=actions)


def forward_only(actions: tuple[Action, ...], *, microbatches: int) -> tuple[Action, ...]:
    """A rank's lowered list reduced to its forward path (F, SEND_F, RECV_F) for microbatches
    < `microbatches`: evaluation runs the schedule's own forward order. Dropping actions only
    removes waits (sends are buffered), so a deadlock-free schedule stays deadlock-free."""
    keep = (K.F, K.SEND_F, K.RECV_F)
    return tuple(a for a in actions if a.kind in keep and a.microbatch < microbatches)


def message_key(a: Action) -> tuple[str, int, int]:
    """(direction, receiving stage, microbatch): the key shared by a send and its recv."""
    if a.kind is K.SEND_F:
        return ("F", a.stage + 1, a.microbatch)
    if a.kind is K.SEND_B:
        return ("B", a.stage - 1, a.microbatch)
    return ("F" if a.kind is K.RECV_F else "B", a.stage, a.microbatch)


def _delivered(recv: Action) -> tuple[int, str, int]:
    """The completion key a recv makes known: F(s-1, i) for RECV_F, B(s+1, i) for RECV_B."""
    if recv.kind is K.RECV_F:
        return (recv.stage - 1, "F", recv.microbatch)
    return (recv.stage + 1, "B", recv.microbatch)


def _run_compute(a: Action, rank: int, known: set, schedule: Schedule) -> None:
    missing = [d for d in dependencies(a, n_stages=schedule.n_stages) if d not in known]
    if missing:
        raise ValueError(
            f"{schedule.name}: {a} on rank {rank} runs before {missing} reached that rank"
        )
    s, i = a.stage, a.microbatch
    known.update([(s, "B", i), (s, "W", i)] if a.kind is K.BW else [(s, a.kind.value, i)])


def execute_lowered(schedule: Schedule) -> list[tuple[int, Action]]:
    """Event-simulate a lowered schedule: sends are buffered, recvs block until their message.

    Each rank knows only what it computed and what its recvs delivered; a compute action whose
    dependency is not known to its rank when it runs is an error (a missing or misplaced recv).
    Returns the global execution order as (rank, action). Raises ValueError on that, on
    deadlock, on a message sent twice, or sent and never received.
    """
    inbox: dict[tuple[str, int, int], int] = {}
    received: set[tuple[str, int, int]] = set()
    known: list[set] = [set() for _ in range(schedule.n_ranks)]
    ptr = [0] * schedule.n_ranks
    order: list[tuple[int, Action]] = []
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(schedule.actions):
            while ptr[rank] < len(acts):
                a = acts[ptr[rank]]
                if a.kind in (K.SEND_F, K.SEND_B):
                    key = message_key(a)
                    if key in inbox or key in received:
                        raise ValueError(f"{schedule.name}: {a} on rank {rank} sends twice")
                    inbox[key] = rank
                elif a.kind in (K.RECV_F, K.RECV_B):
                    if message_key(a) not in inbox:
                        break  # blocking recv
                    received.add(message_key(a))
                    del inbox[message_key(a)]
                    known[rank].add(_delivered(a))
                else:
                    _run_compute(a, rank, known[rank], schedule)
                order.append((rank, a))
                ptr[rank] += 1
                progress = True
    stuck = {r: str(acts[ptr[r]]) for r, acts in enumerate(schedule.actions) if ptr[r] < len(acts)}
    if stuck:
        raise ValueError(f"{schedule.name}: lowered schedule deadlocks, ranks blocked at {stuck}")
    if inbox:
        raise ValueError(f"{schedule.name}: messages sent but never received: {sorted(inbox)}")
    return order

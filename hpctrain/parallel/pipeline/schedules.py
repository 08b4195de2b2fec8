"""Pipeline schedule generators: pure functions of integers returning a `Schedule`.

Notation: p = pipeline ranks, m = microbatches, v = chunks (stages) per rank. Rank i runs stage i
for single-chunk schedules. "In flight" on a rank means forwarded but whose W (or BW) has not run.

- gpipe:            all F, then all BW.
- 1f1b:             p-1-i warm-up F on rank i, then F/BW alternation, then the remaining BW.
- interleaved_1f1b: Megatron's virtual pipeline; stage c·p+i is chunk c of rank i.
- zb_h1:            1F1B with BW split into B and W; rank i defers up to i W's, so in flight
                    stays ≤ p (1F1B's peak) and the deferred W's fill the cooldown bubble.
                    Bubble (p-1)(T_F+T_B-T_W) instead of (p-1)(T_F+T_B+T_W) (Qi et al. 2024).
- zb_h2:            2(p-1-i) warm-up F, up to 2i deferred W's: up to 2p-1 in flight on rank 0,
                    and the only idle time left is the start-up ramp.
- zbv:              two chunks per rank in a V (stage s on rank s for s<p, 2p-1-s otherwise),
                    the ZB-V order of Qi et al. as implemented by torch.distributed.pipelining.
"""

from __future__ import annotations

from collections.abc import Callable

from hpctrain.parallel.pipeline.actions import Action, ActionKind, Schedule

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW


def _linear(name: str, pp: int, m: int, per_rank: list[list[Action]]) -> Schedule:
    return Schedule(
        name=name,
        n_ranks=pp,
        n_stages=pp,
        n_microbatches=m,
        stage_to_rank=tuple(range(pp)),
        actions=tuple(tuple(acts) for acts in per_rank),
    )


def gpipe(pp: int, m: int) -> Schedule:
    """All m forwards, then all m fused backwards, on every rank."""
    per_rank = [
        [Action(r, F, i) for i in range(m)] + [Action(r, BW, i) for i in range(m)]
        for r in range(pp)
    ]
    return _linear("gpipe", pp, m, per_rank)


def _one_f_one_b_rank(r: int, pp: int, m: int, *, warmup: int, defer: int | None) -> list[Action]:
    """One rank's 1F1B-shaped list: `warmup` F, then F/backward pairs, then the tail backwards.

    defer=None fuses the backward (BW); otherwise B and W are split and W of microbatch j runs
    right after the B that leaves more than `defer` W's pending, the rest at the end.
    """
    warmup = min(warmup, m)
    acts = [Action(r, F, i) for i in range(warmup)]
    n_w = 0
    for j in range(m):
        if warmup + j < m:
            acts.append(Action(r, F, warmup + j))
        if defer is None:
            acts.append(Action(r, BW, j))
            continue
        acts.append(Action(r, B, j))
        if j + 1 - n_w > defer:
            acts.append(Action(r, W, n_w))
            n_w += 1
    if defer is not None:
        acts.extend(Action(r, W, j) for j in range(n_w, m))
    return acts


def one_f_one_b(pp: int, m: int) -> Schedule:
    """PipeDream-flush 1F1B: at most p-i microbatches in flight on rank i."""
    per_rank = [_one_f_one_b_rank(r, pp, m, warmup=pp - 1 - r, defer=None) for r in range(pp)]
    return _linear("1f1b", pp, m, per_rank)


def zb_h1(pp: int, m: int) -> Schedule:
    """ZB-H1: 1F1B order with split backward; rank i defers up to i W's (in flight ≤ p)."""
    per_rank = [_one_f_one_b_rank(r, pp, m, warmup=pp - 1 - r, defer=r) for r in range(pp)]
    return _linear("zb_h1", pp, m, per_rank)


def zb_h2(pp: int, m: int) -> Schedule:
    """ZB-H2: 2(p-1-i) warm-up F and up to 2i deferred W's on rank i (in flight ≤ 2p-1)."""
    per_rank = [
        _one_f_one_b_rank(r, pp, m, warmup=2 * (pp - 1 - r), defer=2 * r) for r in range(pp)
    ]
    return _linear("zb_h2", pp, m, per_rank)


def _interleaved_step(k: int, *, pp: int, v: int, backward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of a rank's k-th forward (or backward) in Megatron's order.

    Microbatches advance in groups of pp per chunk: k → chunk (k // pp) % v (reversed for
    backward), microbatch (k // (pp·v))·pp + k % pp.
    """
    chunk = (k // pp) % v
    if backward:
        chunk = v - 1 - chunk
    return chunk, (k // (pp * v)) * pp + k % pp


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Megatron interleaved 1F1B: v chunks per rank, stage c·p+i on rank i; needs m % pp == 0.

    Rank i warms up with 2(p-1-i) + (v-1)·p forwards (capped at m·v), then alternates one
    forward and one fused backward. Bubble time is 1F1B's divided by v.
    """
    if m % pp != 0:
        raise ValueError(
            f"interleaved_1f1b needs parallel.microbatches divisible by parallel.pp, got "
            f"microbatches={m}, pp={pp}: use a multiple of {pp}"
        )
    total = m * v
    per_rank = []
    for r in range(pp):
        warmup = min(2 * (pp - 1 - r) + (v - 1) * pp, total)

        def act(k: int, kind: ActionKind, r: int = r) -> Action:
            chunk, mb = _interleaved_step(k, pp=pp, v=v, backward=kind is BW)
            return Action(chunk * pp + r, kind, mb)

        acts = [act(k, F) for k in range(warmup)]
        for k in range(total):
            if warmup + k < total:
                acts.append(act(warmup + k, F))
            acts.append(act(k, BW))
        per_rank.append(tuple(acts))
    return Schedule(
        name="interleaved_1f1b",
        n_ranks=pp,
        n_stages=pp * v,
        n_microbatches=m,
        stage_to_rank=stage_ranks("interleaved_1f1b", pp=pp, virtual_stages=v),
        actions=tuple(per_rank),
    )


def _zbv_rank(r: int, pp: int, m: int) -> list[Action]:
    """ZB-V order for rank r (chunk 0 = stage r, chunk 1 = stage 2p-1-r).

    Built for n = max(m, 2p-1) microbatches, then the padding microbatches are dropped: each
    microbatch's dependencies stay within that microbatch, so the subsequence remains valid.
    """
    n = max(m, 2 * pp - 1)
    s0, s1 = r, 2 * pp - 1 - r
    cnt = {(s, k): 0 for s in (s0, s1) for k in (F, B, W)}
    acts: list[Action] = []

    def emit(stage: int, *kinds: ActionKind) -> None:
        for kind in kinds:
            acts.append(Action(stage, kind, cnt[stage, kind]))
            cnt[stage, kind] += 1

    for _ in range(2 * (pp - r) - 1):
        emit(s0, F)
    for _ in range(r):
        emit(s1, F)
        emit(s0, F)
    for _ in range(pp - r):
        emit(s1, F, B, W)
    while cnt[s1, F] < cnt[s0, F] or cnt[s0, F] < n:
        if cnt[s0, F] < n:
            emit(s0, F)
        emit(s0, B, W)
        emit(s1, F, B, W)
    for _ in range(r):
        emit(s0, B)
        emit(s1, B)
    for _ in range(pp - r):
        emit(s0, B, W)
    while cnt[s1, W] < cnt[s1, B]:
        emit(s1, W)
    while cnt[s0, W] < cnt[s0, B]:
        emit(s0, W)
    return [a for a in acts if a.microbatch < m]


def zbv(pp: int, m: int) -> Schedule:
    """ZB-V: 2 chunks per rank in a V; near-zero bubble with T_F = T_B = T_W and m ≥ 2p."""
    return Schedule(
        name="zbv",
        n_ranks=pp,
        n_stages=2 * pp,
        n_microbatches=m,
        stage_to_rank=stage_ranks("zbv", pp=pp),
        actions=tuple(tuple(_zbv_rank(r, pp, m)) for r in range(pp)),
    )


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
    "zbv": zbv,
}
# Schedules that keep at most pp microbatches in flight after a warmup: they need m >= pp.
ONE_F_ONE_B_FAMILY = frozenset({"1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv"})
# Schedules that place several model chunks on each rank (zbv always exactly two).
INTERLEAVED = ("interleaved_1f1b", "zbv")


def chunks_per_rank(name: str, virtual_stages: int = 1) -> int:
    """Model chunks (pipeline stages) each rank holds: virtual_stages for interleaved_1f1b,
    2 for zbv, else 1."""
    return 2 if name == "zbv" else virtual_stages if name == "interleaved_1f1b" else 1


def stage_ranks(name: str, *, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The rank of every stage (stage → rank), as the schedule `name` places them: round robin
    (stage s on rank s mod pp), or the V of zbv (rank r holds stages r and 2·pp − 1 − r)."""
    n = pp * chunks_per_rank(name, virtual_stages)
    if name == "zbv":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(n))
    return tuple(s % pp for s in range(n))


def _validate(name: str, *, pp: int, microbatches: int, virtual_stages: int) -> None:
    where = (
        f"parallel.schedule={name}, parallel.pp={pp}, parallel.microbatches={microbatches}, "
        f"parallel.virtual_stages={virtual_stages}"
    )
    if name not in SCHEDULES:
        raise ValueError(f"{where}: unknown schedule; choose one of {', '.join(SCHEDULES)}")
    if pp < 1 or microbatches < 1:
        raise ValueError(f"{where}: pp and microbatches must be >= 1")
    if name in ONE_F_ONE_B_FAMILY and microbatches < pp:
        raise ValueError(
            f"{where}: a 1F1B-family schedule needs microbatches >= pp to fill the pipeline; "
            f"raise parallel.microbatches to at least {pp} or use parallel.schedule=gpipe"
        )
    if name == "interleaved_1f1b":
        if virtual_stages < 2:
            raise ValueError(
                f"{where}: interleaved_1f1b needs virtual_stages >= 2; set "
                f"parallel.virtual_stages=2 or use parallel.schedule=1f1b"
            )
        if microbatches % pp != 0:
            raise ValueError(
                f"{where}: interleaved_1f1b needs microbatches divisible by pp; set "
                f"parallel.microbatches to a multiple of {pp}"
            )
    elif name == "zbv":
        if virtual_stages not in (1, 2):
            raise ValueError(
                f"{where}: zbv always runs 2 chunks per rank; set parallel.virtual_stages to 1 "
                f"(the default) or 2"
            )
    elif virtual_stages != 1:
        raise ValueError(
            f"{where}: {name} runs one stage per rank; set parallel.virtual_stages=1 or use "
            f"parallel.schedule=interleaved_1f1b"
        )


def build_schedule(
    name: str, *, pp: int, microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """Validate the config values and generate the named schedule.

    `virtual_stages` is the number of chunks per rank for interleaved_1f1b (≥ 2). zbv always
    has 2 chunks per rank (2·pp stages); it accepts virtual_stages=1 (the default, meaning "the
    schedule's own layout") or 2. Every other schedule needs virtual_stages=1.
    """
    _validate(name, pp=pp, microbatches=microbatches, virtual_stages=virtual_stages)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, microbatches, virtual_stages)
    return SCHEDULES[name](pp, microbatches)

"""Closed-form pipeline costs: bubble fraction and activations in flight, per schedule.

This is the one place the planner asks "how idle is the pipeline, and how many microbatches'
activations does the busiest rank hold?". The pipeline simulator
(`hpctrain.parallel.pipeline.simulate`, on another branch) answers both exactly for given
T_F, T_B, T_W, T_comm; when it lands, these two functions become thin wrappers around it and
nothing else in the planner changes.

Symbols: p pipeline ranks, m microbatches, v model chunks per rank, T_F/T_B/T_W the per-chunk
forward, input-gradient and weight-gradient times (B here excludes W).
"""

from __future__ import annotations

from hpctrain.plan.layout import SCHEDULES


def _check(schedule: str, pp: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; choose one of {SCHEDULES}")
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"pp={pp}, m={m}, v={v} must all be >= 1")


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
    """Idle fraction of a step: bubble / (bubble + m·v·(T_F+T_B+T_W)).

    bubble, per schedule (Huang et al. 2019; Narayanan et al. 2021; Qi et al. 2024):
      gpipe, 1f1b        (p−1)·(T_F+T_B+T_W)            → (p−1)/(m+p−1) for any times
      interleaved_1f1b   (p−1)·(T_F+T_B+T_W)/v per chunk → (p−1)/(v·m+p−1)
      zb_h1              (p−1)·(T_F+T_B−T_W)
      zb_h2              max(0, (p−1)·(T_F+T_B−2·T_W)) + 2·(p−1)·T_comm   (the paper's form)
      zbv                treated as zb_h2 over v=2 chunks (upper bound until simulated)
    Only zb_h2 charges T_comm, as in Qi et al.'s Table 5; the others ignore it. The defaults
    T_F = T_B = T_W give the usual idealised ratios (zb_h1 = one third of 1f1b's bubble).
    """
    _check(schedule, pp, m, v)
    if pp == 1:
        return 0.0
    work = m * v * (t_f + t_b + t_w)
    if schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        bubble = (pp - 1) * (t_f + t_b + t_w)
    elif schedule == "zb_h1":
        bubble = (pp - 1) * (t_f + t_b - t_w)
    else:  # zb_h2, zbv
        bubble = max(0.0, (pp - 1) * (t_f + t_b - 2 * t_w)) + 2 * (pp - 1) * t_comm
    return bubble / (bubble + work)


def in_flight_microbatches(schedule: str, *, pp: int, m: int, v: int = 1) -> int:
    """Peak (microbatch, chunk) activation sets alive on the busiest rank (the first stage).

    One set = the activations of n_layers/(pp·v) layers for one microbatch, so memory is
    in_flight × that. gpipe keeps all m·v; 1f1b and zb_h1 min(m, p); interleaved_1f1b
    min(m·v, v·p + p − 1) (Megatron's warm-up count + 1, i.e. l·(1 + (p−1)/(p·v)) layers);
    zb_h2 min(m, 2p − 1) (its deeper warm-up); zbv min(2m, 2p) (V shape: p microbatches of
    both chunks, the same bytes as 1f1b).
    """
    _check(schedule, pp, m, v)
    if schedule == "gpipe":
        return m * v
    if schedule in ("1f1b", "zb_h1"):
        return min(m, pp)
    if schedule == "interleaved_1f1b":
        return min(m * v, v * pp + pp - 1)
    if schedule == "zb_h2":
        return min(m, 2 * pp - 1)
    return min(2 * m, 2 * pp)  # zbv

"""Closed forms of the simulator under unit costs, and `check` rejecting broken schedules."""

from dataclasses import replace

import pytest

from hpctrain.parallel.pipeline.actions import Action, ActionKind
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.simulate import check, simulate

PM = [(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 3 * p + 1, 4 * p)]


def bubble_time(result):
    return result.cost - result.work_per_rank


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0)])
@pytest.mark.parametrize("p, m", PM)
def test_classic_bubble(name, costs, p, m):
    """With T_F = 1 and T_B + T_W = 2 (BW twice a forward): bubble = (p-1)/(m+p-1)."""
    t_f, t_b, t_w = costs
    r = simulate(build_schedule(name, pp=p, microbatches=m), t_f=t_f, t_b=t_b, t_w=t_w)
    assert r.bubble_rate == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert r.makespan == pytest.approx(r.cost)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_divides_bubble_time_by_v(v, p, m):
    """Same model split into v chunks per rank (per-stage costs / v): bubble time / v."""
    base = simulate(build_schedule("1f1b", pp=p, microbatches=m), t_f=1.0, t_b=2.0, t_w=0.0)
    il = build_schedule("interleaved_1f1b", pp=p, microbatches=m, virtual_stages=v)
    r = simulate(il, t_f=1.0 / v, t_b=2.0 / v, t_w=0.0)
    assert bubble_time(r) == pytest.approx(bubble_time(base) / v, abs=1e-9)
    assert bubble_time(r) == pytest.approx(3 * (p - 1) / v, abs=1e-9)


@pytest.mark.parametrize("p, m", PM)
def test_zero_bubble_family_with_equal_costs(p, m):
    """T_F = T_B = T_W = 1, no comm: ZB-H1 bubble time is 1/3 of 1F1B's, ZB-H2 ≤ ZB-H1."""
    costs = dict(t_f=1.0, t_b=1.0, t_w=1.0)
    f1b1 = bubble_time(simulate(build_schedule("1f1b", pp=p, microbatches=m), **costs))
    h1 = bubble_time(simulate(build_schedule("zb_h1", pp=p, microbatches=m), **costs))
    h2 = bubble_time(simulate(build_schedule("zb_h2", pp=p, microbatches=m), **costs))
    assert f1b1 == pytest.approx(3 * (p - 1))
    assert h1 == pytest.approx(f1b1 / 3)
    assert h2 <= h1 + 1e-12
    if m >= 2 * p - 1:
        assert h2 == 0.0  # (p-1)(T_F+T_B-2T_W) = 0: a parallelogram with no holes


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_zbv_zero_bubble_with_equal_costs(p, k):
    r = simulate(build_schedule("zbv", pp=p, microbatches=k * p), t_f=1.0, t_b=1.0, t_w=1.0)
    assert r.bubble_rate == 0.0  # exact: every rank is busy from its first to its last action


@pytest.mark.parametrize("p, m", PM)
def test_peak_activations(p, m):
    """1F1B and ZB-H1: p-i on rank i; ZB-H2: up to 2p-1 on rank 0; GPipe: m everywhere."""
    costs = dict(t_f=1.0, t_b=1.0, t_w=1.0)
    peak = {n: simulate(build_schedule(n, pp=p, microbatches=m), **costs).peak_activations
            for n in ("gpipe", "1f1b", "zb_h1", "zb_h2")}
    assert peak["gpipe"] == (m,) * p
    assert peak["1f1b"] == peak["zb_h1"] == tuple(p - i for i in range(p))
    assert peak["zb_h2"] == tuple(min(2 * (p - i) - 1, m) for i in range(p))


def test_comm_adds_per_hop():
    """1F1B, p=2, m=1: F0 → F1 → BW1 → BW0 crosses ranks twice."""
    r = simulate(build_schedule("1f1b", pp=2, microbatches=2), t_f=1, t_b=1, t_w=1, t_comm=0.5)
    r0 = simulate(build_schedule("1f1b", pp=2, microbatches=2), t_f=1, t_b=1, t_w=1)
    assert r.makespan == pytest.approx(r0.makespan + 2 * 0.5)


def _with_rank(schedule, rank, acts):
    actions = list(schedule.actions)
    actions[rank] = tuple(acts)
    return replace(schedule, actions=tuple(actions))


def test_check_rejects_missing_action():
    s = build_schedule("1f1b", pp=3, microbatches=4)
    broken = _with_rank(s, 1, s.actions[1][:-1])
    with pytest.raises(ValueError, match="missing"):
        check(broken)


def test_check_rejects_duplicate_action():
    s = build_schedule("zb_h1", pp=2, microbatches=3)
    broken = _with_rank(s, 0, s.actions[0] + (s.actions[0][0],))
    with pytest.raises(ValueError, match="duplicated"):
        check(broken)


def test_check_rejects_action_on_wrong_rank():
    s = build_schedule("1f1b", pp=2, microbatches=2)
    a = Action(1, ActionKind.F, 0)
    broken = _with_rank(_with_rank(s, 1, [x for x in s.actions[1] if x != a]), 0,
                        (a,) + s.actions[0])
    with pytest.raises(ValueError, match="stage 1 lives on rank 1"):
        check(broken)


def test_check_rejects_deadlock():
    """Rank 1 wants BW(1,0) before F(1,0): its own order contradicts the dependency."""
    s = build_schedule("1f1b", pp=2, microbatches=2)
    acts = list(s.actions[1])
    acts[0], acts[1] = acts[1], acts[0]  # 1F0 1BW0 → 1BW0 1F0
    with pytest.raises(ValueError, match="deadlock"):
        check(_with_rank(s, 1, acts))


def test_check_rejects_cross_rank_deadlock():
    """Rank 0 waits for 1BW0 before sending 0F1; rank 1 wants 1F1 before 1BW0: a cycle."""
    s = build_schedule("gpipe", pp=2, microbatches=2)
    rank0 = [Action.parse(t) for t in ("0F0", "0BW0", "0F1", "0BW1")]
    rank1 = [Action.parse(t) for t in ("1F0", "1F1", "1BW0", "1BW1")]
    broken = _with_rank(_with_rank(s, 0, rank0), 1, rank1)
    with pytest.raises(ValueError, match=r"deadlock, ranks blocked at \{0: '0BW0', 1: '1F1'\}"):
        check(broken)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_makespan_bubble_charges_start_ramp(p):
    """From t = 0, ZB-H2 and ZB-V keep the last rank's start-up ramp (p-1)(T_F + T_comm).

    ZB-H2's rank-span bubble is then its closed form (p-1)(T_F+T_B-2T_W) + 2(p-1)T_comm.
    """
    costs = dict(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.25)
    r = simulate(build_schedule("zb_h2", pp=p, microbatches=4 * p), **costs)
    assert r.makespan - r.work_per_rank == pytest.approx((p - 1) * 1.25)
    assert r.cost - r.work_per_rank == pytest.approx(2 * (p - 1) * 0.25)
    r = simulate(build_schedule("zbv", pp=p, microbatches=4 * p), t_f=1.0, t_b=1.0, t_w=1.0)
    assert r.makespan - r.work_per_rank == pytest.approx(p - 1)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_zbv_peak_activations_match_1f1b_in_model_units(p):
    """2p half-size stage activations on every rank = 1F1B's rank-0 peak of p full stages."""
    r = simulate(build_schedule("zbv", pp=p, microbatches=3 * p), t_f=1.0, t_b=1.0, t_w=1.0)
    assert r.peak_activations == (2 * p,) * p

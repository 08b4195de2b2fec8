"""The planner's bubble and in-flight counts are the pipeline simulator's, for every schedule."""

import pytest

from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.simulate import simulate
from hpctrain.plan.bubble import bubble_fraction, in_flight_microbatches

COSTS = [(1.0, 1.0, 1.0, 0.0), (1.0, 2.0, 1.0, 0.0), (1.0, 1.3, 0.4, 0.05), (2.0, 1.0, 3.0, 0.2)]
GRID = [("gpipe", p, m, 1) for p, m in ((2, 1), (4, 8))] + [
    (s, p, m, 1) for s in ("1f1b", "zb_h1", "zb_h2") for p, m in ((2, 2), (4, 5), (8, 8), (4, 16))
] + [("interleaved_1f1b", p, m, v) for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2))
     ] + [("zbv", p, m, 2) for p, m in ((2, 2), (4, 6), (4, 8), (8, 16))]


@pytest.mark.parametrize("schedule, p, m, v", GRID)
def test_planner_bubble_equals_simulator(schedule, p, m, v):
    sched = build_schedule(schedule, pp=p, microbatches=m, virtual_stages=v)
    for t_f, t_b, t_w, t_comm in COSTS:
        sim = simulate(sched, t_f=t_f, t_b=t_b, t_w=t_w, t_comm=t_comm)
        got = bubble_fraction(schedule, pp=p, m=m, v=v, t_f=t_f, t_b=t_b, t_w=t_w,
                              t_comm=t_comm)
        assert got == pytest.approx(sim.bubble_rate, rel=1e-3, abs=1e-9), (t_f, t_b, t_w)
    assert in_flight_microbatches(schedule, pp=p, m=m, v=v) == max(
        simulate(sched, t_f=1.0, t_b=1.0, t_w=1.0).peak_activations)


def test_the_cases_the_closed_forms_got_wrong():
    """Issue 17: ZB-H2 with p <= m < 2p-1 is not bubble-free; ZB-V with T_B != T_F."""
    assert bubble_fraction("zb_h2", pp=8, m=8) == pytest.approx(0.2258, abs=1e-4)
    got = bubble_fraction("zbv", pp=4, m=8, v=2, t_f=1.0, t_b=2.0, t_w=1.0)
    assert got == pytest.approx(0.0857, abs=1e-4)


def test_matches_zero_bubble_table5(reference):
    """Qi et al. Table 5, every schedule column, from their profiled per-stage times."""
    for row in reference("zero_bubble_table5.csv"):
        costs = {k: float(row[k]) for k in ("t_f", "t_b", "t_w", "t_comm")}
        for schedule in ("1f1b", "zb_h1", "zb_h2"):
            got = bubble_fraction(schedule, pp=int(row["p"]), m=int(row["m"]), **costs)
            assert got == pytest.approx(float(row[schedule]), abs=1e-3), (row["model"], schedule)


def test_no_pipeline_and_unknown_schedule():
    assert bubble_fraction("1f1b", pp=1, m=8) == 0.0
    assert in_flight_microbatches("gpipe", pp=1, m=8) == 1
    with pytest.raises(ValueError, match="schedule='dualpipe' is unknown"):
        bubble_fraction("dualpipe", pp=2, m=2)
    with pytest.raises(ValueError, match="t_f=0"):
        bubble_fraction("1f1b", pp=2, m=2, t_f=0.0)

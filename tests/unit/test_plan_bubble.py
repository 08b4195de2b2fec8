"""Closed-form bubble fractions and activations in flight."""

import pytest

from hpctrain.plan.bubble import bubble_fraction, in_flight_microbatches


def test_gpipe_and_1f1b_closed_form():
    for schedule in ("gpipe", "1f1b"):
        assert bubble_fraction(schedule, pp=4, m=8) == pytest.approx(3 / 11)
    assert bubble_fraction("1f1b", pp=1, m=8) == 0.0


def test_interleaving_divides_the_bubble_by_v():
    assert bubble_fraction("interleaved_1f1b", pp=4, m=8, v=2) == pytest.approx(3 / 19)


def test_zb_h1_is_a_third_of_1f1b_bubble_with_equal_times():
    p, m = 8, 24
    assert bubble_fraction("zb_h1", pp=p, m=m) == pytest.approx((p - 1) / (3 * m + p - 1))


def test_zb_h2_matches_zero_bubble_table5(reference):
    """Qi et al. Table 5's ZB-H2 column is this closed form on their profiled times."""
    for row in reference("zero_bubble_table5.csv"):
        got = bubble_fraction(
            "zb_h2", pp=int(row["p"]), m=int(row["m"]), t_f=float(row["t_f"]),
            t_b=float(row["t_b"]), t_w=float(row["t_w"]), t_comm=float(row["t_comm"]),
        )
        assert got == pytest.approx(float(row["zb_h2"]), abs=5e-4), row["model"]


def test_in_flight_per_schedule():
    assert in_flight_microbatches("gpipe", pp=4, m=8) == 8
    assert in_flight_microbatches("1f1b", pp=4, m=8) == 4
    assert in_flight_microbatches("1f1b", pp=4, m=2) == 2
    assert in_flight_microbatches("interleaved_1f1b", pp=4, m=8, v=2) == 11
    assert in_flight_microbatches("zb_h2", pp=4, m=8) == 7
    assert in_flight_microbatches("zbv", pp=4, m=8, v=2) == 8


def test_unknown_schedule_is_rejected():
    with pytest.raises(ValueError, match="schedule='dualpipe' is unknown"):
        bubble_fraction("dualpipe", pp=2, m=2)

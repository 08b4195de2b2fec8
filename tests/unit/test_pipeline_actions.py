import pytest

from hpctrain.parallel.pipeline.actions import Action, ActionKind, Schedule
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.schedules import SCHEDULES, build_schedule


@pytest.mark.parametrize(
    "text, action",
    [
        ("2F5", Action(2, ActionKind.F, 5)),
        ("0BW3", Action(0, ActionKind.BW, 3)),
        ("1SEND_F4", Action(1, ActionKind.SEND_F, 4)),
        ("12RECV_B10", Action(12, ActionKind.RECV_B, 10)),
        ("3W0", Action(3, ActionKind.W, 0)),
    ],
)
def test_compact_form_round_trip(text, action):
    assert str(action) == text
    assert Action.parse(text) == action


@pytest.mark.parametrize("bad", ["F5", "2X5", "2F", "", "2f5"])
def test_parse_rejects_malformed(bad):
    with pytest.raises(ValueError, match="<stage><kind><microbatch>"):
        Action.parse(bad)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_csv_round_trip(name):
    v = 2 if name == "interleaved_1f1b" else 1
    schedule = build_schedule(name, pp=4, microbatches=8, virtual_stages=v)
    for s in (schedule, lower_comm(schedule)):
        text = s.to_csv()
        assert text.startswith(f"# name={name};")
        assert len(text.strip().splitlines()) == 1 + s.n_ranks
        assert Schedule.from_csv(text) == s


def test_schedule_rejects_inconsistent_placement():
    with pytest.raises(ValueError, match="stage_to_rank has 1 entries but n_stages=2"):
        Schedule("x", n_ranks=1, n_stages=2, n_microbatches=1, stage_to_rank=(0,), actions=((),))

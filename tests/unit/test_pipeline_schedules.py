import pytest

from hpctrain.parallel.pipeline.actions import ActionKind
from hpctrain.parallel.pipeline.lowering import execute_lowered, lower_comm
from hpctrain.parallel.pipeline.schedules import SCHEDULES, build_schedule
from hpctrain.parallel.pipeline.simulate import check


def _grid():
    for name in SCHEDULES:
        for pp in (1, 2, 3, 4, 8):
            for m in sorted({1, pp, pp + 1, 2 * pp, 3 * pp + 1, 4 * pp}):
                for v in {"interleaved_1f1b": (2, 3), "zbv": (1, 2)}.get(name, (1,)):
                    try:
                        yield build_schedule(name, pp=pp, microbatches=m, virtual_stages=v)
                    except ValueError:
                        continue  # invalid combination: covered by the error tests


GRID = list(_grid())


def test_grid_covers_every_schedule():
    assert {s.name for s in GRID} == set(SCHEDULES)
    assert len(GRID) > 150


def _id(s):
    return f"{s.name}-{s.n_stages}x{s.n_microbatches}"


@pytest.mark.parametrize("schedule", GRID, ids=_id)
def test_every_schedule_is_complete_and_deadlock_free(schedule):
    check(schedule)
    lowered = lower_comm(schedule)
    order = execute_lowered(lowered)
    assert len(order) == sum(len(a) for a in lowered.actions)
    sends = [a for _, a in order if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B)]
    recvs = [a for _, a in order if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)]
    assert len(sends) == len(recvs)
    # every cross-rank edge carries exactly one message per microbatch and direction
    cross = sum(
        1 for s in range(schedule.n_stages - 1)
        if schedule.stage_to_rank[s] != schedule.stage_to_rank[s + 1]
    )
    assert len(sends) == 2 * cross * schedule.n_microbatches


def test_placement():
    assert build_schedule("zbv", pp=4, microbatches=8).stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    il = build_schedule("interleaved_1f1b", pp=2, microbatches=4, virtual_stages=3)
    assert il.stage_to_rank == (0, 1, 0, 1, 0, 1)
    assert build_schedule("zb_h1", pp=3, microbatches=3).stage_to_rank == (0, 1, 2)


def test_split_and_fused_backward():
    kinds = {a.kind for acts in build_schedule("1f1b", pp=2, microbatches=4).actions for a in acts}
    assert kinds == {ActionKind.F, ActionKind.BW}
    kinds = {a.kind for acts in build_schedule("zb_h2", pp=2, microbatches=4).actions for a in acts}
    assert kinds == {ActionKind.F, ActionKind.B, ActionKind.W}


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(name="zb_h3", pp=4, microbatches=8), ["parallel.schedule=zb_h3", "zb_h1, zb_h2"]),
        (dict(name="1f1b", pp=4, microbatches=3), ["parallel.microbatches=3", "at least 4"]),
        (dict(name="zbv", pp=8, microbatches=4), ["parallel.pp=8", "at least 8"]),
        (dict(name="interleaved_1f1b", pp=4, microbatches=8, virtual_stages=1),
         ["parallel.virtual_stages=1", "set parallel.virtual_stages=2"]),
        (dict(name="interleaved_1f1b", pp=4, microbatches=6, virtual_stages=2),
         ["parallel.microbatches=6", "multiple of 4"]),
        (dict(name="zb_h1", pp=4, microbatches=8, virtual_stages=2),
         ["parallel.virtual_stages=2", "set parallel.virtual_stages=1"]),
        (dict(name="zbv", pp=4, microbatches=8, virtual_stages=3),
         ["parallel.virtual_stages=3", "1 (the default) or 2"]),
        (dict(name="gpipe", pp=0, microbatches=8), ["parallel.pp=0", ">= 1"]),
    ],
)
def test_build_schedule_errors_name_values_and_fix(kwargs, needles):
    name = kwargs.pop("name")
    with pytest.raises(ValueError) as err:
        build_schedule(name, **kwargs)
    for needle in needles:
        assert needle in str(err.value)


def test_gpipe_allows_fewer_microbatches_than_stages():
    check(build_schedule("gpipe", pp=4, microbatches=2))

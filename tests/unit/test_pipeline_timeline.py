from hpctrain.parallel.pipeline.report import format_table, simulation_report
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.simulate import simulate
from hpctrain.parallel.pipeline.timeline import draw_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_timeline_png(tmp_path):
    schedule = build_schedule("zb_h1", pp=4, microbatches=8)
    result = simulate(schedule, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.1)
    path = draw_timeline(result.boxes(), tmp_path / "zb_h1.png", title="zb_h1 p=4 m=8")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_timeline_accepts_measured_boxes_with_unknown_kinds(tmp_path):
    boxes = [[(0.0, 1.0, "0", "F"), (1.5, 2.0, "", "SEND_F")], [(1.0, 2.5, "0", "BW")]]
    data = draw_timeline(boxes, tmp_path / "m.png", title="measured").read_bytes()
    assert data[:8] == PNG_MAGIC


def test_report_and_table():
    schedule = build_schedule("interleaved_1f1b", pp=2, microbatches=4, virtual_stages=2)
    costs = dict(t_f=1.0, t_b=2.0, t_w=0.0, t_comm=0.0)
    report = simulation_report(schedule, simulate(schedule, **costs), costs=costs)
    assert report["schedule"] == "interleaved_1f1b"
    assert (report["pp"], report["microbatches"], report["virtual_stages"]) == (2, 4, 2)
    assert report["costs"] == costs
    assert len(report["peak_activations"]) == 2
    assert 0.0 < report["bubble_rate"] < 1.0
    table = format_table(report)
    assert "bubble rate" in table and "interleaved_1f1b" in table
    assert len({line.index(line.split()[-1]) > 0 for line in table.splitlines()}) == 1

"""The hang watchdog's rules and report, without a stuck job: slow/hung step times, who is
named from the heartbeats, the Slurm --exclude line, one claim per report."""

from __future__ import annotations

import json
import os
import time

import pytest

from hpctrain.distributed import hang_report
from hpctrain.distributed.watchdog import StallRule, Watchdog, beat_interval


def test_stall_rule_waits_for_a_median():
    rule = StallRule(timeout_s=300)
    assert rule.verdict(10_000.0, [0.1, 0.1]) == "ok"  # 2 steps: warm-up, the group timeout rules
    assert rule.verdict(29.0, [0.1] * 3) == "ok"  # floor 30 s
    assert rule.verdict(31.0, [0.1] * 3) == "slow"
    assert rule.verdict(301.0, [0.1] * 3) == "hung"


def test_stall_rule_scales_with_the_median_step():
    rule = StallRule(timeout_s=300)
    slow_steps = [10.0, 12.0, 11.0, 500.0]  # one outlier does not move the median (11.5 s)
    assert rule.slow_after(rule.median(slow_steps)) == pytest.approx(115.0)
    assert rule.verdict(100.0, slow_steps) == "ok"
    assert rule.verdict(120.0, slow_steps) == "slow"
    # A step legitimately longer than the timeout: hung only after k × median.
    long_steps = [40.0, 40.0, 40.0]
    assert rule.verdict(350.0, long_steps) == "ok"  # past timeout_s, within 10 × 40 s
    assert rule.verdict(401.0, long_steps) == "hung"


def test_stall_rule_floor_is_half_a_short_timeout():
    rule = StallRule(timeout_s=10)
    assert rule.verdict(4.9, [0.01] * 5) == "ok"
    assert rule.verdict(5.1, [0.01] * 5) == "slow"
    assert rule.verdict(10.1, [0.01] * 5) == "hung"
    assert beat_interval(10) == 1.0 and beat_interval(300) == 10.0 and beat_interval(1) == 0.5


def test_watchdog_times_steps_and_warns_once_per_step(tmp_path):
    wd = Watchdog(tmp_path, rank=0, world_size=1, timeout_s=10)
    assert wd.check(time.monotonic() + 100) == "ok"  # not armed before the first step
    for step in range(4):
        wd.step(step)
        wd.since -= 0.01  # each step "took" 10 ms
    assert len(wd.durations) == 3 and wd.rule.median(list(wd.durations)) >= 0.01
    assert wd.check(wd.since + 1.0) == "ok"
    assert wd.check(wd.since + 6.0) == "slow"
    wd._warn_slow()  # dumps this process's stacks
    assert "test_watchdog_times_steps" in (tmp_path / "hang" / "stacks_rank0.txt").read_text()
    assert wd.check(wd.since + 6.0) == "ok"  # warned once for this step
    assert wd.check(wd.since + 11.0) == "hung"
    wd.idle("final checkpoint")
    assert wd.check(wd.since + 1000.0) == "ok"


def _beat(rank, *, step, age, now, host="n1", pid=None):
    return {"rank": rank, "host": host, "pid": pid or os.getpid(), "step": step,
            "phase": "train", "beat": now - age}


def test_suspects_names_the_silent_rank_then_the_one_behind():
    now = time.time()
    beats = {0: _beat(0, step=7, age=0.5, now=now), 1: _beat(1, step=7, age=20, now=now)}
    assert [r for r, _ in hang_report.suspects(beats, now=now, stale_s=5)] == [1]
    assert "stopped responding" in hang_report.suspects(beats, now=now, stale_s=5)[0][1]
    assert "reached step" not in hang_report.suspects(beats, now=now, stale_s=5)[0][1]
    beats[0] = _beat(0, step=9, age=0.5, now=now)  # short steps: its beat lags the step
    assert hang_report.suspects(beats, now=now, stale_s=5)[0][1].endswith(
        "was in step 7 (train); the ranks still running reached step 9 and wait for it there")
    beats[0] = _beat(0, step=7, age=0.5, now=now)
    beats[1] = _beat(1, step=6, age=0.5, now=now)
    (rank, why), = hang_report.suspects(beats, now=now, stale_s=5)
    assert rank == 1 and "behind in step 6" in why
    beats[1] = _beat(1, step=7, age=0.5, now=now)
    assert hang_report.suspects(beats, now=now, stale_s=5) == []
    beats[1] = None
    assert hang_report.suspects(beats, now=now, stale_s=5) == [(1, "never wrote a heartbeat")]


def test_suspects_sees_a_dead_process_on_this_host_at_once():
    now = time.time()
    dead = _beat(1, step=3, age=0.1, now=now, host=hang_report.node_name(), pid=2**22 + 12345)
    (rank, why), = hang_report.suspects({0: _beat(0, step=3, age=0, now=now), 1: dead},
                                        now=now, stale_s=5)
    assert rank == 1 and "has exited" in why


def _write_beats(folder, beats):
    folder.mkdir(parents=True)
    for rank, beat in beats.items():
        (folder / f"rank_{rank}.json").write_text(json.dumps(beat))


def test_message_names_rank_host_step_and_the_slurm_exclude_line(tmp_path):
    now = time.time()
    _write_beats(tmp_path / "heartbeat", {0: _beat(0, step=7, age=0, now=now, host="n1"),
                                          1: _beat(1, step=7, age=30, now=now, host="gpu-17")})
    beats = hang_report.read_heartbeats(tmp_path / "heartbeat", world_size=2)
    culprits = hang_report.suspects(beats, now=now, stale_s=5)
    args = dict(reporter=0, host="n1", step=7, phase="train", where="all_reduce from x.py:3",
                culprits=culprits, hang_dir=tmp_path, beats_dir=tmp_path / "heartbeat")
    text = hang_report.format_message("Timed out", slurm=True, **args)
    assert text.startswith("hang: rank 1 (host gpu-17) stopped responding")
    assert "step 7 (train)" in text and "waiting in all_reduce from x.py:3" in text
    assert "--exclude=gpu-17 (or cluster.exclude=gpu-17)" in text
    assert "--exclude" not in hang_report.format_message("Timed out", slurm=False, **args)
    assert "no checkpoint was saved yet, so it starts from step 0" in text
    saved = hang_report.format_message("Timed out", slurm=False, saved=tmp_path / "step_00000005",
                                       **args)
    assert "Resubmit and it resumes from its last checkpoint (step_00000005)" in saved
    args["culprits"] = []
    assert "every rank waits in the same collective" in hang_report.format_message(
        "Timed out", slurm=True, **args)


def test_a_dead_rank_not_yet_reaped_has_exited():
    """A SIGKILLed rank stays a zombie until its launcher reaps it: it has exited all the same
    (it was once named "behind in step N" for the step of its last beat)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # exited, not reaped: /proc shows it as a zombie
        state = open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        time.sleep(0.05)
    now = time.time()
    try:
        beats = {0: _beat(0, step=30, age=0, now=now, host=hang_report.node_name()),
                 1: _beat(1, step=29, age=0.1, now=now, host=hang_report.node_name(),
                          pid=child.pid)}
        (rank, why), = hang_report.suspects(beats, now=now, stale_s=5)
        assert rank == 1 and why.startswith("has exited"), why
    finally:
        child.wait()


def test_a_new_step_is_on_disk_within_the_beat_gap(tmp_path):
    """The interval is 10 s at the default timeout; a new step is written within ~1 s, so a
    rank that stops is named with the step it reached."""
    from hpctrain.distributed.watchdog import BEAT_GAP_S

    wd = Watchdog(tmp_path, rank=0, world_size=1, timeout_s=300)
    assert wd.interval_s == 10.0 and wd.beat_gap_s == BEAT_GAP_S
    # a large job's ranks together write at most 100 beats a second
    assert Watchdog(tmp_path, rank=0, world_size=1000, timeout_s=300).beat_gap_s == 10.0
    assert Watchdog(tmp_path, rank=0, world_size=400, timeout_s=300).beat_gap_s == 4.0
    with wd:
        for step in (1, 2):
            wd.step(step)
            time.sleep(BEAT_GAP_S * 1.6)
            beat = json.loads((tmp_path / ".hpctrain" / "heartbeat" / "rank_0.json").read_text())
            assert beat["step"] == step


def test_only_the_first_claim_writes_the_report(tmp_path):
    assert hang_report.claim(tmp_path / "report.txt", "first")
    assert not hang_report.claim(tmp_path / "report.txt", "second")
    assert (tmp_path / "report.txt").read_text() == "first\n"
    hang_report.archive_previous(tmp_path.parent)  # no hang/ there: nothing happens
    (tmp_path / "hang").mkdir()
    hang_report.archive_previous(tmp_path)
    assert not (tmp_path / "hang").exists() and (tmp_path / "hang.prev").is_dir()


def test_comm_failures_are_told_from_other_errors():
    gloo = RuntimeError("[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
                        "for recv operation to complete")
    assert hang_report.is_comm_failure(gloo)
    assert hang_report.first_line(gloo) == ("Timed out waiting 10000ms for recv operation to "
                                            "complete")
    lost = RuntimeError("[a.cc:1] Connection closed by peer [127.0.0.1]:1. This is typically ..")
    assert hang_report.first_line(lost) == "Connection closed by peer [127.0.0.1]:1"
    assert not hang_report.is_comm_failure(ValueError("model.dim=7 is odd"))


def test_last_collective_reads_the_flight_recorder():
    entry = {"profiling_name": "gloo:all_reduce", "process_group": ["0", "default_pg"],
             "collective_seq_id": 22}
    trace = json.dumps({"entries": [dict(entry, process_group=["1", "dp"]), entry]}).encode()
    assert hang_report.last_collective(trace) == "gloo:all_reduce on the world group (#22)"
    assert hang_report.last_collective(None) is None
    assert hang_report.last_collective(b"{}") is None

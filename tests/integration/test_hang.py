"""Fault injection on a real dp=2 `python -m hpctrain` run: a SIGSTOPped rank is named and the
job ends; SIGINT/SIGTERM to the launcher stop it with a checkpoint; a killed rank is named; no
process is left behind in any case."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.harness import die_with_parent

TIMEOUT_S = 10
RUN = ["model=debug", "train=debug", "parallel=dp2", "cluster.procs_per_node=2",
       "data.max_bytes=200000", "logger.wandb=disabled", "logger.progress=plain",
       "train.steps=100000", "train.log_every=1000", "train.eval_every=0",
       "train.checkpoint_every=0", f"cluster.timeout_s={TIMEOUT_S}"]


def _start(run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    return subprocess.Popen([sys.executable, "-m", "hpctrain", *RUN, f"hydra.run.dir={run_dir}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            preexec_fn=die_with_parent)  # no orphan if pytest is killed


def _beat(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((run_dir / ".hpctrain" / "heartbeat" / f"rank_{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def _wait_training(proc, run_dir: Path, *, min_step: int = 3, limit_s: float = 60) -> None:
    """Until both ranks' heartbeats report step ≥ min_step."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        beats = [_beat(run_dir, r) for r in (0, 1)]
        if all(b and (b["step"] or 0) >= min_step for b in beats):
            return
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read()[-3000:])
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # a 100,000-step run must not outlive the test
    raise AssertionError(f"the run did not start training within {limit_s} s")


def _children() -> dict[int, int]:
    """pid → parent pid of every process on this machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                out[int(entry.name)] = int(stat[stat.rfind(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def _descendants(pid: int) -> set[int]:
    parents, found, frontier = _children(), set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int], *, grace_s: float = 3.0) -> set[int]:
    """Those of `pids` still running `grace_s` from now (multiprocessing's resource tracker
    leaves a moment after the launcher)."""
    deadline = time.monotonic() + grace_s
    while (alive := _running(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _running(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _finish(proc, *, limit_s: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out, time.monotonic() - t0


def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path):
    proc = _start(tmp_path)
    _wait_training(proc, tmp_path)
    family = _descendants(proc.pid)
    stopped = _beat(tmp_path, 1)["pid"]
    t_stop = time.time()
    os.kill(stopped, signal.SIGSTOP)
    code, out, exit_s = _finish(proc, limit_s=TIMEOUT_S + 20)
    report = tmp_path / "hang" / "report.txt"
    detect_s = report.stat().st_mtime - t_stop
    assert code == 3, out[-3000:]
    assert detect_s < TIMEOUT_S + 3, detect_s  # a step boundary + the timeout + one beat
    assert exit_s < TIMEOUT_S + 12, exit_s  # + the launcher's grace and teardown (loaded CI)
    assert out.count("hang: rank 1 (host ") == 2, out[-3000:]  # the rank's report, the exit line
    assert "stopped responding" in report.read_text()
    # rank 0 waits in the dp gradient all-reduce or the world's stop-flag all-reduce
    assert re.search(r"last collective issued: gloo:all_reduce on the (dp|world) group",
                     report.read_text())
    assert "Traceback" not in out, out[-3000:]
    # its stack: in the training step, or in the step loop's stop agreement (the world group)
    stacks = (tmp_path / "hang" / "stacks_rank0.txt").read_text()
    assert re.search(r"in (train_one|_should_stop)", stacks), stacks
    assert (tmp_path / "hang" / "flight_recorder_rank0.json").stat().st_size > 100
    assert stopped in family and not (left := _alive(family)), left


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_launcher_signal_stops_with_a_checkpoint(tmp_path, sig):
    proc = _start(tmp_path)
    _wait_training(proc, tmp_path)
    family = _descendants(proc.pid)
    os.kill(proc.pid, sig)  # the launcher alone, not its process group
    code, out, exit_s = _finish(proc, limit_s=30)
    assert code == 128 + sig, out[-3000:]
    assert exit_s < 15, exit_s
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "train_state.json").exists()
    assert f"stopped by {signal.Signals(sig).name}" in out
    assert len(family) >= 2 and not (left := _alive(family)), left


def test_a_signal_to_one_rank_stops_every_rank_and_is_not_success(tmp_path):
    """Issue 45: SIGTERM to one rank (not the launcher) stopped the run with a checkpoint and
    exit 0, so a script read an unfinished run as done."""
    proc = _start(tmp_path)
    _wait_training(proc, tmp_path)
    os.kill(int(_beat(tmp_path, 1)["pid"]), signal.SIGTERM)
    code, out, _ = _finish(proc, limit_s=30)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by a signal to a rank before train.steps: checkpoint saved" in out, out[-3000:]
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "train_state.json").exists()


def test_a_killed_launchers_ranks_stop_with_a_checkpoint_and_no_traceback(tmp_path):
    proc = _start(tmp_path)
    _wait_training(proc, tmp_path)
    family = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the ranks get SIGTERM from the kernel (PDEATHSIG)
    code, out, _ = _finish(proc, limit_s=30)  # the output ends when the ranks have exited
    assert code == -signal.SIGKILL, out[-3000:]
    assert "Traceback" not in out and "BrokenPipeError" not in out, out[-3000:]
    assert out.count("the launcher is gone: this rank's result was not delivered") == 2, out
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "train_state.json").exists()
    assert not (left := _alive(family)), left


def test_a_second_sigint_kills_at_once(tmp_path):
    proc = _start(tmp_path)
    _wait_training(proc, tmp_path)
    family = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)
    code, out, exit_s = _finish(proc, limit_s=30)
    assert code == 130 and exit_s < 5, (code, exit_s, out[-3000:])
    assert "a second SIGINT killed ranks [0, 1] at once" in out, out[-3000:]
    assert not (left := _alive(family)), left


def test_a_killed_rank_ends_the_job_named(tmp_path):
    proc = _start(tmp_path)
    _wait_training(proc, tmp_path)
    family = _descendants(proc.pid)
    victim = _beat(tmp_path, 1)["pid"]
    os.kill(victim, signal.SIGKILL)
    code, out, exit_s = _finish(proc, limit_s=30)
    assert code != 0 and exit_s < 10, (code, exit_s)
    assert f"rank 1 (pid {victim}) was killed by SIGKILL (its last heartbeat: step" in out
    assert not (left := _alive(family)), left


OOM_SITE = '''"""Rank 1 runs out of memory in step 3: raised from outside hpctrain's code."""
import torch
import torch.distributed as dist
from hpctrain.train import trainer

_original = trainer.Trainer.train_one


def train_one(self):
    if self.step == 3 and dist.get_rank() == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return _original(self)


trainer.Trainer.train_one = train_one
'''


def test_out_of_memory_ends_with_the_step_rank_peaks_and_fix(tmp_path):
    """A torch.OutOfMemoryError in one rank (a sitecustomize in the ranks' interpreter): exit 4
    and one message with the step, the rank, the measured and predicted peaks and the fix; the
    prediction is written next to the history (the CUDA snapshot itself: tests/gpu)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(OOM_SITE)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1",
           "WANDB_SILENT": "true"}
    run = [a for a in RUN if not a.startswith("train.steps=")] + ["train.steps=8"]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *run,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr[-3000:]
    line = next(ln for ln in proc.stderr.splitlines() if "out of memory in step 3 on rank 1" in ln)
    assert re.search(r"measured peak [\d.]+ GiB resident \(max RSS\), the planner predicted "
                     r"[\d.e-]+ GiB a rank \(states", line), line
    assert "Fix: lower train.micro_batch_size" in line
    saved = json.loads((tmp_path / "run" / "oom" / "rank_1_predicted.json").read_text())
    assert saved["step"] == 3 and saved["predicted_bytes"]["total"] > 0
    assert "raised OutOfMemoryError" in (tmp_path / "run" / "hang" / "report.txt").read_text()


def test_a_straggler_is_named_within_its_window(tmp_path):
    """SIGSTOP/SIGCONT pulses on rank 1 (0.15 s of every 0.25 s) from step 25 until a window
    names it (on a loaded machine the first windows' noise can hide a pulse, and a stop that
    falls inside a collective delays both ranks alike: the pulses go on, at most 40 s; at 0.1 s
    of every 0.25 s, CI's loaded machine once named nobody in five windows): rank 1 is the first
    named from step 30 on, with its host, by the end of the third whole window of 10 steps; with
    cluster.exclude_stragglers its host is kept for the next restart's exclusion. (Windows
    before the pulses are not asserted: under the suite's own load one once named rank 1 at
    1.22× the median; nor later ones: rank 0 was once named at 1.20× after the pulses. That is
    what the rule says of such noise at threshold 0.2.)"""
    run = [a for a in RUN if not a.startswith("train.steps=")] + [
        "train.steps=80", "train.global_batch_size=64", "cluster.straggler_window=10",
        "cluster.exclude_stragglers=true"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", *run, f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=die_with_parent)
    _wait_training(proc, tmp_path, min_step=25, limit_s=120)
    victim, started = _beat(tmp_path, 1)["pid"], time.monotonic()
    metrics = tmp_path / "metrics.jsonl"
    while (proc.poll() is None and time.monotonic() - started < 40
           and "straggler_ranks" not in (metrics.read_text() if metrics.exists() else "")):
        os.kill(victim, signal.SIGSTOP)
        time.sleep(0.15)
        os.kill(victim, signal.SIGCONT)
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    windows = [(int(m.group(2)), ln) for ln in out.splitlines()
               if (m := re.search(r"straggler in steps (\d+)\.\.(\d+)", ln))]
    # windows ending before the pulses: under the suite's own load (up to 9 on these 2 cores,
    # Slurm jobs beside) the first one once named rank 1 at 1.22x the median, which is what
    # the rule says of such noise at threshold 0.2; the pulses' window is what is asserted
    named = [ln for end, ln in windows if end >= 30]
    assert named and "rank 1 (host " in named[0] and "rank 0 " not in named[0], out[-3000:]
    first = int(re.search(r"straggler in steps (\d+)\.\.(\d+)", named[0]).group(2))
    assert first <= 60, named[0]  # pulses from step >= 25
    assert _beat(tmp_path, 1)["host"] in json.loads(
        (tmp_path / ".hpctrain" / "stragglers.json").read_text())
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("straggler_ranks") == [1] and r.get("loss") for r in records)
    assert all("compute_ratio_max" in r for r in records if "straggler_ranks" in r)

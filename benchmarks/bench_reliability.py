"""Faults against a real `python -m hpctrain` run: time to detection and exit, what was kept;
and the per-step cost of the hang watchdog.

Every scenario starts the real entry point in its own session (so a stopped run cannot take
the benchmark with it), injects one fault and measures from the fault to the launcher's exit:

  sigstop     dp=2, cluster.timeout_s=10: SIGSTOP one rank mid-training (hang detection)
  sigint      dp=2: SIGINT to the launcher (agreed stop with a checkpoint)
  sigterm     dp=2: SIGTERM to the launcher
  kill_rank   dp=2: SIGKILL one rank
  nan         single rank: optim.lr=1e4 with no clipping/warm-up (the NaN guard's stop)
  busy_dir    a second run on a directory that a live run owns (refused)
  damaged     resume after random bytes in the newest checkpoint's shard (fallback)
  wandb_down  logger.wandb=auto with an API key and an unreachable server
  kill_launcher  dp=2: SIGKILL the launcher (its ranks stop through SIGTERM, with a checkpoint)
  disk_full   dp=2 on a 3 MB tmpfs: the third checkpoint does not fit; then space is freed and
              the same command resumes (root only)
  read_only   a run directory on a read-only filesystem (root only)
  bad_cache   the prepared token cache truncated to 1,000 tokens (refused before launch)
  slurm_node_down  on the local Slurm cluster (slurm/local/start.sh), dp=4 on 2 nodes × 2
              tasks, cluster.elastic: n2 set DOWN mid-run; requeued without it, dp=2 on n1
  slurm_hang  the same, a rank on n2 SIGSTOPped (cluster.timeout_s=20)

The Slurm scenarios time each phase from the fault: detection (the fault recorded), the job
running again, the run resumed, training again (its first new step), and the steps lost; and,
for the time a person needs today, the same job's submission to its first step.

Usage: python benchmarks/bench_reliability.py [--only sigstop,nan,...] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from hpctrain.distributed.rundir import heartbeat_dir  # noqa: E402

BASE = ["model=debug", "train=debug", "data.max_bytes=200000", "logger.wandb=disabled",
        "logger.progress=plain", "train.eval_every=0", "train.log_every=1000"]
DP2 = ["parallel=dp2", "cluster.procs_per_node=2"]
LONG = ["train.steps=100000"]


def start(run_dir: Path, *over: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
           **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "hpctrain", *BASE, *over,
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def beat(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((heartbeat_dir(run_dir) / f"rank_{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def wait_step(proc, run_dir: Path, *, ranks=(0, 1), step: int = 10, limit_s: float = 120):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        beats = [beat(run_dir, r) for r in ranks]
        if all(b and (b.get("step") or 0) >= step for b in beats):
            return beats
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read()[-2000:])
        time.sleep(0.1)
    raise RuntimeError("the run did not reach the step")


def finish(proc, *, limit_s: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out
    return proc.returncode, out


def last_error(out: str) -> str:
    lines = [ln for ln in out.splitlines() if " ERROR]" in ln or "ERROR" in ln[:40]]
    return (lines[-1] if lines else out.strip().splitlines()[-1])[-240:]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def scenario_sigstop(tmp: Path) -> dict:
    run_dir = tmp / "sigstop"
    proc = start(run_dir, *DP2, *LONG, "cluster.timeout_s=10")
    victim = wait_step(proc, run_dir)[1]["pid"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    wall0 = time.time()
    code, out = finish(proc)
    exit_s = time.monotonic() - t0
    report = run_dir / "hang" / "report.txt"
    detect_s = report.stat().st_mtime - wall0 if report.exists() else None
    os.kill(victim, signal.SIGKILL) if _running(victim) else None
    steps = {f"rank{r}_last_beat_step": (beat(run_dir, r) or {}).get("step") for r in (0, 1)}
    return {"exit_code": code, "detect_s": detect_s, "exit_s": exit_s, **steps,
            "kept": sorted(p.name for p in (run_dir / "hang").iterdir()),
            "message": report.read_text().splitlines()[0][:240] if report.exists() else None}


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _launcher_signal(tmp: Path, sig: signal.Signals) -> dict:
    run_dir = tmp / sig.name.lower()
    proc = start(run_dir, *DP2, *LONG, "train.checkpoint_every=0")
    wait_step(proc, run_dir)
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    code, out = finish(proc)
    return {"exit_code": code, "exit_s": time.monotonic() - t0, "kept": checkpoints(run_dir),
            "message": last_error(out)}


def scenario_sigint(tmp: Path) -> dict:
    return _launcher_signal(tmp, signal.SIGINT)


def scenario_sigterm(tmp: Path) -> dict:
    return _launcher_signal(tmp, signal.SIGTERM)


def scenario_kill_rank(tmp: Path) -> dict:
    run_dir = tmp / "kill_rank"
    proc = start(run_dir, *DP2, *LONG, "train.checkpoint_every=5")
    victim = wait_step(proc, run_dir, step=12)[1]["pid"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code, out = finish(proc)
    return {"exit_code": code, "exit_s": time.monotonic() - t0, "kept": checkpoints(run_dir),
            "message": last_error(out)}


def scenario_nan(tmp: Path) -> dict:
    run_dir = tmp / "nan"
    t0 = time.monotonic()
    proc = start(run_dir, "train.steps=50", "optim.lr=1e4", "train.grad_clip=0",
                 "optim.warmup_steps=0", "train.checkpoint_every=1")
    code, out = finish(proc)
    return {"exit_code": code, "run_s": time.monotonic() - t0, "kept": checkpoints(run_dir),
            "message": last_error(out)}


def scenario_busy_dir(tmp: Path) -> dict:
    run_dir = tmp / "busy"
    owner = start(run_dir, *LONG)
    wait_step(owner, run_dir, ranks=(0,), step=2)
    record = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    t0 = time.monotonic()
    code, out = finish(start(run_dir, "train.steps=2"))
    refused_s = time.monotonic() - t0
    untouched = record == {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    os.killpg(owner.pid, signal.SIGTERM)
    finish(owner)
    return {"exit_code": code, "refused_s": refused_s, "message": last_error(out),
            "live_record_untouched": untouched}


def scenario_damaged(tmp: Path) -> dict:
    run_dir = tmp / "damaged"
    finish(start(run_dir, "train.steps=8", "train.checkpoint_every=4"))
    newest = run_dir / "checkpoints" / checkpoints(run_dir)[-1]
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    at = random.Random(0).randrange(len(data) // 4, len(data) - 600)
    data[at:at + 512] = random.Random(1).randbytes(512)
    shard.write_bytes(bytes(data))
    t0 = time.monotonic()
    code, out = finish(start(run_dir, "train.steps=10", "train.checkpoint_every=4"))
    skipped = [ln for ln in out.splitlines() if "skipping" in ln]
    resumed = [ln for ln in out.splitlines() if "resumed from" in ln]
    return {"exit_code": code, "run_s": time.monotonic() - t0,
            "skipped": skipped[0][-200:] if skipped else None,
            "resumed": resumed[0][-160:] if resumed else None, "kept": checkpoints(run_dir)}


def scenario_wandb_down(tmp: Path) -> dict:
    env = {"WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": "http://10.255.255.1:443"}
    out = {}
    for mode in ("disabled", "auto"):
        t0 = time.monotonic()
        code, text = finish(start(tmp / f"wandb_{mode}", "train.steps=5",
                                  f"logger.wandb={mode}", env=env))
        out[mode] = {"exit_code": code, "run_s": time.monotonic() - t0}
        if mode == "auto":
            warn = [ln for ln in text.splitlines() if "W&B" in ln and "offline" in ln]
            out[mode]["message"] = warn[0][-200:] if warn else None
    return out


def scenario_kill_launcher(tmp: Path) -> dict:
    run_dir = tmp / "kill_launcher"
    proc = start(run_dir, *DP2, *LONG)
    wait_step(proc, run_dir)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    code, out = finish(proc)  # the output ends when the last rank has exited
    return {"exit_code": code, "ranks_gone_s": time.monotonic() - t0,
            "kept": checkpoints(run_dir)[-1:], "tracebacks": out.count("Traceback"),
            "message": last_error(out.replace("WARNING", "ERROR"))}


def _tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def scenario_disk_full(tmp: Path) -> dict:
    disk = tmp / "disk_full"
    if not _tmpfs(disk, "size=3m"):
        return {"skipped": "cannot mount a tmpfs (needs root)"}
    try:
        run = [*DP2, "train.steps=8", "train.checkpoint_every=1", "train.keep=2"]
        t0 = time.monotonic()
        code, out = finish(start(disk / "run", *run))
        full = {"exit_code": code, "run_s": time.monotonic() - t0,
                "tracebacks": out.count("Traceback"), "kept": checkpoints(disk / "run"),
                "message": last_error(out)}
        subprocess.run(["mount", "-o", "remount,size=40m", str(disk)], check=True)
        t0 = time.monotonic()
        code, out = finish(start(disk / "run", *run))
        resumed = [ln for ln in out.splitlines() if "resumed from" in ln]
        return {"full": full, "after_space_freed": {
            "exit_code": code, "run_s": time.monotonic() - t0,
            "resumed": resumed[0][-120:] if resumed else None}}
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def scenario_read_only(tmp: Path) -> dict:
    disk = tmp / "read_only"
    if not _tmpfs(disk, "size=1m,ro"):
        return {"skipped": "cannot mount a tmpfs (needs root)"}
    try:
        t0 = time.monotonic()
        code, out = finish(start(disk / "run", "train.steps=2"))
        return {"exit_code": code, "refused_s": time.monotonic() - t0,
                "tracebacks": out.count("Traceback"), "message": out.strip()[-240:]}
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def scenario_bad_cache(tmp: Path) -> dict:
    cache = ["train.steps=2", f"data.cache_dir={tmp / 'cache'}"]
    finish(start(tmp / "cache_ok", *cache))
    (train,) = (tmp / "cache" / "data").glob("*/train.bin")
    with open(train, "r+b") as f:
        f.truncate(2000)  # 1,000 uint16 tokens left
    t0 = time.monotonic()
    code, out = finish(start(tmp / "cache_bad", *cache))
    return {"exit_code": code, "refused_s": time.monotonic() - t0,
            "ranks_started": "rank0" in out, "message": last_error(out)}


SLURM_RUN = ["cluster=slurm_local", "cluster.elastic=true", "cluster.timeout_s=20",
             "parallel=dp2", "parallel.dp=4", "train.global_batch_size=64", "train.steps=80",
             "train.checkpoint_every=10", "model=debug", "train=debug", "data.max_bytes=200000",
             "logger.wandb=disabled", "logger.progress=plain", "train.eval_every=0"]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


def _until(pred, limit_s: float, what: str):
    deadline = time.monotonic() + limit_s
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {limit_s} s")
        time.sleep(0.05)
    return value


def _job_running(job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                         text=True, timeout=30).stdout
    return out.strip() == "RUNNING"


def _slurm_fault(tmp: Path, name: str, inject) -> dict:
    sweep, run_dir = tmp / name, tmp / name / "0"
    env = {**os.environ, "WANDB_SILENT": "true"}
    submitted = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "-m", *SLURM_RUN,
                             f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = _until(lambda: (_metrics(run_dir) or [None])[0], 180, "the first step")
        _until(lambda: len(_metrics(run_dir)) >= 30, 180, "30 steps")
        job = next(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir())
        fault_at = time.time()
        inject(run_dir)
        fault = run_dir / ".hpctrain" / "fault.json"
        _until(fault.exists, 120, "the fault record")
        detected = fault.stat().st_mtime
        _until(lambda: not _job_running(job), 60, "the job leaving RUNNING")
        _until(lambda: _job_running(job), 180, "the job running again")
        running = time.time()
        record = _until(lambda: (run_dir / "restarts.jsonl").exists() and json.loads(
            (run_dir / "restarts.jsonl").read_text().splitlines()[0]), 180, "the restart")
        resumed = record["resumed_step"]
        again = _until(lambda: next((r for r in _metrics(run_dir)
                                     if r["time"] > fault_at and r["step"] > resumed), None),
                       180, "a new step")
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    return {"exit": proc.returncode, "cause": record["cause"], "nodes": record["nodes"],
            "detected_s": detected - fault_at, "running_again_s": running - fault_at,
            "resumed_s": record["restarted"] - fault_at,
            "training_again_s": again["time"] - fault_at,
            "steps_lost": record["steps_lost"], "world": [record["world_before"],
                                                          record["world_after"]],
            "layout": [record["layout_before"], record["layout_after"]],
            "step_time_s": [first["step_time_s"], again["step_time_s"]],
            "submit_to_first_step_s": first["time"] - submitted, "tail": out[-300:]}


def scenario_slurm_node_down(tmp: Path) -> dict:
    def down(run_dir: Path) -> None:
        subprocess.run(["scontrol", "update", "nodename=n2", "state=down",
                        "reason=bench_reliability"], check=True, timeout=30)
    try:
        return _slurm_fault(tmp, "node_down", down)
    finally:
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], timeout=30,
                       capture_output=True)


def scenario_slurm_hang(tmp: Path) -> dict:
    def stop(run_dir: Path) -> None:
        pid = json.loads((heartbeat_dir(run_dir) / "rank_3.json").read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
    return _slurm_fault(tmp, "hang", stop)


def watchdog_cost(tmp: Path) -> dict:
    from hpctrain.distributed.watchdog import Watchdog

    wd = Watchdog(tmp / "wd", rank=0, world_size=1, timeout_s=300)
    wd.beats_dir.mkdir(parents=True, exist_ok=True)  # what start() prepares
    n = 200_000
    step_us = timeit.timeit(lambda: wd.step(1), number=n) / n * 1e6
    beat_us = timeit.timeit(wd._write_beat, number=500) / 500 * 1e6
    return {"step_call_us": step_us, "heartbeat_write_us": beat_us,
            "heartbeat_every_s": wd.interval_s}


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items()
             if name.startswith("scenario_")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-reliability-") as tmp:
        results["watchdog"] = watchdog_cost(Path(tmp))
        print("watchdog", json.dumps(results["watchdog"]), flush=True)
        for name in args.only.split(","):
            results[name] = SCENARIOS[name](Path(tmp))
            print(name, json.dumps(results[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

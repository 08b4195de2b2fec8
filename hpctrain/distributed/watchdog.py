"""The hang watchdog: one daemon thread per rank that turns a stuck job into one clear message.

The trainer calls `heartbeat.step(n)` at every step boundary (an attribute write and a deque
append: no I/O, no collective). The thread writes this rank's heartbeat file
`<run_dir>/.hpctrain/heartbeat/rank_N.json` (rank, host, pid, step, phase, beat time) every
`interval_s`, and within `beat_gap_s` of a new step (1 s; longer in jobs of over 100 ranks, so
they write at most JOB_BEATS_PER_S beats together), so the step a stopped or dead rank reached
is known to its peers; and it applies `StallRule` to the time since the last boundary:

- slow: longer than max(k × median of the last 50 step times, floor) — k = 10, floor =
  min(30 s, timeout_s / 2). The rank dumps its Python stacks into `<run_dir>/hang/` and warns
  once per step; nothing ends.
- hung: longer than max(cluster.timeout_s, k × median) — the job is ended (`report`, then exit
  `EXIT_HANG`): a step whose collectives cannot finish within the process-group timeout cannot
  finish at all.

Both rules start once 3 steps have completed (a median exists): the first steps' warm-up can be
slow on a loaded machine, and a wait stuck in them still fails through the group timeout.

A collective or point-to-point wait that times out (or loses its peer) raises in the main thread
instead; `launch.worker` hands that error to the same `report`. A rank that is stopped (SIGSTOP,
a frozen node) or dead cannot report: the live ranks name it from the heartbeat files, in which
its beat is stale (`hang_report.suspects`). The first rank to claim `<run_dir>/hang/report.txt`
logs the one message; the others only dump their stacks.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from hpctrain.distributed import hang_report, rundir

log = logging.getLogger(__name__)

EXIT_HANG = 3  # exit status of a rank ended by the watchdog (2 is a refused configuration)
Verdict = Literal["ok", "slow", "hung"]


class Heartbeat(Protocol):
    def step(self, step: int, *, phase: str = "train") -> None: ...
    def idle(self, phase: str) -> None: ...


class _NoHeartbeat:
    """The heartbeat of a mesh without a watchdog (tests, tools): does nothing."""

    def step(self, step: int, *, phase: str = "train") -> None:
        pass

    def idle(self, phase: str) -> None:
        pass


NO_HEARTBEAT: Heartbeat = _NoHeartbeat()


@dataclass(frozen=True)
class StallRule:
    """When a step counts as slow (warn, dump stacks) and when as hung (end the job)."""

    timeout_s: float
    k: float = 10.0
    floor_s: float = 30.0
    min_steps: int = 3

    def median(self, durations: list[float]) -> float | None:
        return statistics.median(durations) if len(durations) >= self.min_steps else None

    def slow_after(self, median: float) -> float:
        return max(self.k * median, min(self.floor_s, self.timeout_s / 2))

    def hung_after(self, median: float) -> float:
        return max(self.timeout_s, self.k * median)

    def verdict(self, elapsed_s: float, durations: list[float]) -> Verdict:
        """"ok" until `min_steps` steps have completed: the first steps (warm-up, lazy
        initialisation) are covered by the process-group timeout alone."""
        median = self.median(durations)
        if median is None:
            return "ok"
        if elapsed_s > self.hung_after(median):
            return "hung"
        return "slow" if elapsed_s > self.slow_after(median) else "ok"


BEAT_GAP_S = 1.0  # a new step's heartbeat is written within this (at most one write a second)
JOB_BEATS_PER_S = 100  # ... unless the job's ranks together would write more often than this


def beat_interval(timeout_s: float) -> float:
    """Heartbeat period: a tenth of the timeout, within [0.5 s, 10 s] (1000 ranks writing a
    small file every 10 s is light for a shared file system)."""
    return min(10.0, max(0.5, timeout_s / 10))


class Watchdog:
    """This rank's heartbeat and its watching thread (`start`/`stop`, or use as a context)."""

    def __init__(self, run_dir: Path | str, *, rank: int, world_size: int, timeout_s: float,
                 rule: StallRule | None = None,
                 on_fault: Callable[[hang_report.Fault], None] | None = None):
        self.run_dir = Path(run_dir)
        self.dir = rundir.hang_dir(run_dir)  # created only when a hang is suspected
        self.beats_dir = rundir.heartbeat_dir(run_dir)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.rule = rule or StallRule(timeout_s)
        self.interval_s = beat_interval(timeout_s)
        # a new step's beat: within 1 s up to 100 ranks; larger jobs space them out so the
        # shared file system sees at most JOB_BEATS_PER_S writes (1,000 ranks: every 10 s)
        self.beat_gap_s = min(self.interval_s, max(BEAT_GAP_S, world_size / JOB_BEATS_PER_S))
        self.host, self.pid = hang_report.node_name(), os.getpid()
        self.current: int | None = None  # the step running now (completed steps so far)
        self.phase, self.armed = "setup", False
        self.since = time.monotonic()
        self.durations: deque[float] = deque(maxlen=50)
        self._warned: int | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._reported = False
        self._beat_failed = False
        self._thread: threading.Thread | None = None
        # Called by the rank that claims the report, before it exits (Slurm: requeue).
        self.on_fault = on_fault

    # -- called by the training loop (cheap) ----------------------------------------------
    def step(self, step: int, *, phase: str = "train") -> None:
        """A step boundary: step `step` starts now."""
        now = time.monotonic()
        if self.armed:
            self.durations.append(now - self.since)
        self.since, self.current, self.phase, self.armed = now, step, phase, True

    def idle(self, phase: str) -> None:
        """Leave the step loop (final save, summary): no step-time rule applies any more; a
        stuck collective still raises through the process-group timeout."""
        self.phase, self.armed = phase, False

    def failed(self, err: BaseException) -> None:
        """This rank raised `err` and ends: its last beat says so, so the peers that report
        the lost rank name the error (a fault of the code: nothing is requeued)."""
        error = f"{type(err).__name__}: {hang_report.first_line(err)}"
        self.phase, self.armed = hang_report.FAILED + error, False
        self._write_beat()

    # -- the thread ------------------------------------------------------------------------
    def check(self, now: float) -> Verdict:
        if not self.armed:
            return "ok"
        verdict = self.rule.verdict(now - self.since, list(self.durations))
        return "ok" if verdict == "slow" and self._warned == self.current else verdict

    def start(self) -> Watchdog:
        self.beats_dir.mkdir(parents=True, exist_ok=True)
        self._write_beat()
        self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        """Wake every `beat_gap_s`: write the heartbeat when the step changed (so a rank that
        stops or dies leaves the step it really reached, at most that old) or the interval is
        up; apply the stall rule."""
        written, last = self.current, time.monotonic()
        while not self._stop.wait(self.beat_gap_s):
            now = time.monotonic()
            if self.current != written or now - last >= self.interval_s:
                written, last = self.current, now
                self._write_beat()
            verdict = self.check(now)
            if verdict == "slow":
                self._warn_slow()
            elif verdict == "hung":
                elapsed = time.monotonic() - self.since
                self.report(f"no step completed for {elapsed:.0f} s (cluster.timeout_s="
                            f"{self.timeout_s:g})", frame=_main_frame())
                exit_now(EXIT_HANG)

    def _write_beat(self) -> None:
        state = {"rank": self.rank, "host": self.host, "pid": self.pid, "step": self.current,
                 "phase": self.phase, "step_s": round(time.monotonic() - self.since, 3),
                 "beat": time.time()}
        path = self.beats_dir / f"rank_{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path)
        except OSError as err:  # a full or vanished run dir must not kill the rank
            if not self._beat_failed:  # once: the run's own writes report the disk
                log.warning("cannot write heartbeat %s: %s (peers may not name this rank "
                            "if it stops)", path, err)
            self._beat_failed = True

    def _warn_slow(self) -> None:
        self._warned = self.current
        elapsed = time.monotonic() - self.since
        median = self.rule.median(list(self.durations))
        self.dump_stacks()
        stacks = self.dir / f"stacks_rank{self.rank}.txt"
        log.warning("step %s has run %.1f s (median step %.3f s): stacks in %s; the job ends "
                    "if it does not finish within %.0f s", self.current, elapsed, median or 0.0,
                    stacks, self.rule.hung_after(median or 0.0))

    # -- the report ------------------------------------------------------------------------
    def dump_stacks(self, *, tb=None) -> bytes | None:
        """Every thread's Python stack of this rank (faulthandler) and, given `tb`, the
        traceback of the wait that failed; plus torch's flight recorder where it records
        (returned)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / f"stacks_rank{self.rank}.txt").open("w") as f:
            f.write(f"rank {self.rank} host {self.host} pid {self.pid} step {self.current} "
                    f"phase {self.phase} at {time.strftime('%H:%M:%S')}\n")
            if tb is not None:
                f.write("The wait that failed (most recent call last):\n")
                f.writelines(traceback.format_tb(tb))
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        return hang_report.dump_flight_recorder(
            self.dir / f"flight_recorder_rank{self.rank}.json")

    def report(self, cause: str, *, frame=None, tb=None) -> str | None:
        """Dump this rank's stacks, name the rank that holds the job up (from the heartbeats)
        and log the one message if this rank is the first to claim it. Returns the message,
        or None when this rank had reported already."""
        with self._lock:
            if self._reported:
                return None
            self._reported = True
        self._write_beat()
        trace = self.dump_stacks(tb=tb)
        where = hang_report.waiting_in(frame=frame, tb=tb)
        collective = hang_report.last_collective(trace)
        if collective:
            where = f"{where + ', ' if where else ''}last collective issued: {collective}"
        beats = hang_report.read_heartbeats(self.beats_dir, world_size=self.world_size)
        culprits = hang_report.suspects(beats, now=time.time(), stale_s=3 * self.interval_s + 2)
        message = hang_report.format_message(
            cause, reporter=self.rank, host=self.host, step=self.current, phase=self.phase,
            where=where, culprits=culprits,
            hang_dir=self.dir, beats_dir=self.beats_dir, slurm=hang_report.on_slurm(),
            saved=next(iter(rundir.checkpoints(self.run_dir)), None),
            requeues=self.on_fault is not None)
        if hang_report.claim(self.dir / "report.txt", message):
            log.error("%s", message)
            if self.on_fault is not None:
                fault = hang_report.fault(message, step=self.current, culprits=culprits,
                                          beats=beats, beats_dir=self.beats_dir)
                try:
                    self.on_fault(fault)
                except Exception:  # noqa: BLE001 - the rank must still end (exit_now follows)
                    log.exception("the launcher's fault handler failed; the job ends without "
                                  "a requeue")
        else:
            log.info("stacks of rank %d written to %s (the hang was reported by another rank)",
                     self.rank, self.dir)
        return message


def _main_frame():
    return sys._current_frames().get(threading.main_thread().ident)


def exit_now(code: int) -> None:
    """End this rank from the watchdog thread: the main thread is blocked in a wait that may
    never return, so no unwinding; flush the logs first."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)

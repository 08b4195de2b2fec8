"""The local launcher's watch over its rank processes: results, signals, failures, no orphans.

`supervise` waits on every rank's exit and result pipe at once, and ends the job in one of
these ways, always with every rank process reaped (no manager process exists to orphan):

- every rank exits 0: the results are returned, unless the ranks stopped early on a signal
  sent to one of them (not to the launcher): then `JobStopped` with exit status 128 + SIGTERM,
  since the run is not done (a scheduler or script must not read it as success);
- SIGINT/SIGTERM to the launcher: forwarded to the ranks as SIGTERM, which stop through the
  agreed preemption path (`launch.preempt`: checkpoint at the next step boundary, then exit);
  ranks still alive `stop_grace_s` later are killed; a second SIGINT kills them at once.
  `JobStopped` with exit status 128 + signal;
- a rank exits non-zero or is killed: the other ranks get `fail_grace_s` to finish their hang
  report (if any), then are killed; `JobStopped` naming the rank, its pid, how it ended and its
  last step (from its heartbeat), or the watchdog's report when one was written.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from hpctrain.distributed import rundir
from hpctrain.distributed.watchdog import EXIT_HANG
from hpctrain.errors import RunStopped

log = logging.getLogger(__name__)


class JobStopped(RunStopped):
    """The job ended before every rank finished; `exit_code` is what the launcher exits with."""


class _Signals:
    """Signals received by the launcher while it supervises (handlers only record them)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame) -> None:
        self.seen.append(signum)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()


def _forward(procs, signum: int) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signum)


def supervise(procs: list, pipes: list[Connection], *, run_dir: Path, stop_grace_s: float,
              fail_grace_s: float = 2.0) -> dict[int, Any]:
    """Wait for the rank processes `procs` (rank = index) and collect what each sends on its
    pipe; raise `JobStopped` unless all of them exit 0 without a stop signal."""
    results: dict[int, Any] = {}
    open_pipes = dict(enumerate(pipes))
    sig, deadline, failed = _Signals(), None, None
    ended: dict[int, int] = {}  # rank → exit code, of the ranks that ended badly by themselves
    sig.install()
    try:
        while True:
            _receive(open_pipes, results, procs)
            # one look at the exit codes per round: the loop's end and the verdict agree (a rank
            # that exits between two looks cannot end the loop unseen)
            codes = [p.exitcode for p in procs]
            now = time.monotonic()
            if deadline is None or now <= deadline:  # not yet killed by this supervisor
                ended.update((r, c) for r, c in enumerate(codes) if c not in (None, 0))
            if sig.seen and deadline is None:
                name = signal.Signals(sig.seen[0]).name
                log.warning("%s: stopping the ranks at their next step boundary, with a "
                            "checkpoint (another SIGINT kills them now)", name)
                _forward(procs, signal.SIGTERM)
                deadline = now + stop_grace_s
            if len(sig.seen) > 1 and signal.SIGINT in sig.seen[1:]:
                _kill(procs)
            if failed is None and not sig.seen:
                failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
                if failed is not None:
                    deadline = now + fail_grace_s
            if all(c is not None for c in codes) and not open_pipes:
                break
            if deadline is not None and now > deadline:
                _kill(procs)
    finally:
        _kill(procs)
        for p in procs:
            p.join()
        sig.restore()
    if failed is not None:
        failed = _cause(ended) if ended else failed
    _raise_if_stopped(procs, failed=failed, signals=sig.seen, run_dir=run_dir,
                      stop_grace_s=stop_grace_s, results=results)
    return results


def _receive(open_pipes: dict[int, Connection], results: dict[int, Any], procs) -> None:
    """Wait up to 0.2 s for a result or a rank's exit; read every result that arrived (a rank
    sends one; a pipe at EOF belongs to a rank that exited without one)."""
    live = [p.sentinel for p in procs if p.is_alive()]
    ready = wait(list(open_pipes.values()) + live, timeout=0.2)
    for rank, conn in list(open_pipes.items()):
        if conn in ready:
            try:
                results[rank] = conn.recv()
            except (EOFError, OSError):
                pass
            del open_pipes[rank]


def _raise_if_stopped(procs, *, failed: int | None, signals: list[int], run_dir: Path,
                      stop_grace_s: float, results: dict[int, Any]) -> None:
    if signals:
        name = signal.Signals(signals[0]).name
        killed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if not killed:
            how = "every rank saved its checkpoint and exited"
        elif signal.SIGINT in signals[1:]:
            how = (f"a second SIGINT killed ranks {killed} at once: the last periodic "
                   "checkpoint is kept")
        else:
            how = (f"ranks {killed} did not exit within {stop_grace_s:g} s "
                   "(cluster.signal_delay_s) and were killed: the last periodic checkpoint is "
                   "kept")
        raise JobStopped(f"stopped by {name}: {how}", exit_code=128 + signals[0])
    by_signal = [r for r in sorted(results) if isinstance(results[r], dict)
                 and results[r].get("stopped_by_signal")]
    if failed is None and by_signal:  # a rank was signalled (not this launcher): not done
        saved = results[by_signal[0]].get("checkpoint")
        raise JobStopped(f"stopped by a signal to a rank before train.steps: checkpoint saved "
                         f"({saved}); run the same command again to continue",
                         exit_code=128 + signal.SIGTERM)
    if failed is None:
        return
    stopped = [results[r] for r in sorted(results)
               if isinstance(results[r], dict) and "stopped" in results[r]]
    if stopped:  # the ranks stopped on purpose (RunStopped, a refusal): their one message
        raise JobStopped(stopped[0]["stopped"], exit_code=stopped[0]["exit_code"])
    report = rundir.hang_dir(run_dir) / "report.txt"
    if report.exists() and procs[failed].exitcode == EXIT_HANG:  # it reported; else it died
        first = report.read_text().splitlines()[0]
        code = procs[failed].exitcode
        raise JobStopped(f"{first} (full report: {report})", exit_code=code if code > 0 else 1)
    raise JobStopped(_death_message(procs, failed, run_dir), exit_code=1)


def _cause(ended: dict[int, int]) -> int:
    """The rank whose end brought the job down, among those that ended badly by themselves
    (rank → exit code): one killed by a signal before one that exited with an error, and
    either before one that reported a hang (once a rank is gone its peers' collectives fail
    or stall, and they may exit first)."""
    def order(r: int) -> tuple[int, int]:
        code = ended[r]
        return (0 if code < 0 else 2 if code == EXIT_HANG else 1), r

    return min(ended, key=order)


def _death_message(procs, rank: int, run_dir: Path) -> str:
    p = procs[rank]
    code = p.exitcode
    how = (f"was killed by {signal.Signals(-code).name}" if code < 0 else
           f"exited with status {code} (its error is above)")
    where = ""
    try:
        beat = json.loads((rundir.heartbeat_dir(run_dir) / f"rank_{rank}.json").read_text())
        where = f" (its last heartbeat: step {beat.get('step')}, {beat.get('phase')})"
    except (OSError, ValueError):
        pass
    saved = next(iter(rundir.checkpoints(run_dir)), None)
    resume = (f"Resubmit to resume from the last checkpoint ({saved.name})." if saved else
              "No checkpoint was saved yet: a rerun starts from step 0.")
    return f"rank {rank} (pid {p.pid}) {how}{where}; the other ranks were stopped. {resume}"

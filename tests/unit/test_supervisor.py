"""The local launcher's supervisor names the rank that brought a job down, whatever order the
ranks' exits are seen in: a rank killed by a signal is the cause, its peers that then reported
a hang are not; a rank the supervisor itself killed after the grace is never the cause."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from hpctrain.distributed import rundir
from hpctrain.distributed.watchdog import EXIT_HANG
from hpctrain.launch.supervisor import JobStopped, supervise


def _exit(code: int, after_s: float) -> None:
    time.sleep(after_s)
    os._exit(code)


def _killed(after_s: float) -> None:
    time.sleep(after_s)
    os.kill(os.getpid(), signal.SIGKILL)


def _stuck() -> None:
    time.sleep(60)


def _supervise(targets, run_dir) -> str:
    ctx = mp.get_context("fork")
    procs, readers = [], []
    for target, args in targets:
        reader, writer = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=target, args=args))
        procs[-1].start()
        writer.close()
        readers.append(reader)
    report = rundir.hang_dir(run_dir) / "report.txt"
    report.parent.mkdir(parents=True)
    report.write_text("hang: rank 1 was last in step 8 (train)\n")
    with pytest.raises(JobStopped) as stop:
        supervise(procs, readers, run_dir=run_dir, stop_grace_s=5, fail_grace_s=1.0)
    return str(stop.value)


def test_a_killed_rank_is_named_even_after_its_peer_reported_a_hang(tmp_path):
    # rank 0 sees its peer gone and exits with the hang status first; rank 1 was SIGKILLed
    message = _supervise([(_exit, (EXIT_HANG, 0.0)), (_killed, (0.4,))], tmp_path)
    assert message.startswith("rank 1 (pid ") and "killed by SIGKILL" in message, message


def test_the_hang_report_is_the_cause_when_the_supervisor_killed_the_stuck_rank(tmp_path):
    message = _supervise([(_exit, (EXIT_HANG, 0.0)), (_stuck, ())], tmp_path)
    assert message.startswith("hang: rank 1 was last in step 8"), message


def test_an_error_exit_comes_before_a_hang_report(tmp_path):
    message = _supervise([(_exit, (EXIT_HANG, 0.0)), (_exit, (1, 0.3))], tmp_path)
    assert message.startswith("rank 1 (pid ") and "exited with status 1" in message, message
    assert message.endswith("No checkpoint was saved yet: a rerun starts from step 0.")
    saved = tmp_path / "with" / "checkpoints"
    (saved / "step_00000020").mkdir(parents=True)
    (saved / "step_00000030.partial").mkdir()  # being written: not a checkpoint yet
    message = _supervise([(_exit, (1, 0.0)), (_stuck, ())], tmp_path / "with")
    assert message.endswith("Resubmit to resume from the last checkpoint (step_00000020).")


class _Rank:
    """A rank that has sent `result` and exits with `code` at the `dies_at`-th look at its
    state (is_alive, exitcode) after its result was read: every moment a real rank can exit
    at, relative to the supervisor's looks, made deterministic."""

    def __init__(self, result, code: int, dies_at: int) -> None:
        reader, writer = mp.Pipe(duplex=False)
        writer.send(result)
        writer.close()
        self.conn, self.code, self.dies_at = reader, code, dies_at
        self.read, self.looks, self.pid = False, 0, os.getpid()
        self._death_r, self._death_w = os.pipe()  # readable once dead: the sentinel

    def fileno(self) -> int:
        return self.conn.fileno()

    def recv(self):
        self.read = True
        return self.conn.recv()

    def _alive(self) -> bool:
        if self.read and self._death_w is not None:
            self.looks += 1
            if self.looks > self.dies_at:
                os.close(self._death_w)
                self._death_w = None
        return self._death_w is not None

    @property
    def sentinel(self) -> int:
        return self._death_r

    def is_alive(self) -> bool:
        return self._alive()

    @property
    def exitcode(self):
        return None if self._alive() else self.code

    def kill(self) -> None:
        pass

    def join(self) -> None:
        pass


@pytest.mark.parametrize("dies_at", range(5))
def test_ranks_that_stop_right_after_their_message_stop_the_job(tmp_path, dies_at):
    # both ranks stop on purpose (exit 3 after their message); whenever they exit relative to
    # the supervisor's looks, the job stops with their message and status (CI once saw exit 0)
    stop = {"stopped": "step 2: non-finite grad norm", "exit_code": 3}
    ranks = [_Rank(stop, 3, dies_at), _Rank(stop, 3, dies_at)]
    with pytest.raises(JobStopped) as stopped:
        supervise(ranks, ranks, run_dir=tmp_path, stop_grace_s=5, fail_grace_s=1.0)
    assert str(stopped.value) == stop["stopped"] and stopped.value.exit_code == 3


def test_ranks_that_oversubscribe_the_cores_are_told():
    from hpctrain.launch.local import oversubscribed
    from tests.conftest import make_config

    four = make_config(["model=debug", "train=debug", "parallel.dp=4",
                        "cluster.procs_per_node=4", "cluster.device=cpu",
                        "train.global_batch_size=8"])
    assert oversubscribed(four, cores=2).startswith(
        "4 rank(s) × cluster.threads_per_proc=1 = 4 threads on 2 core(s): the ranks "
        "oversubscribe this machine")
    assert oversubscribed(four, cores=4) is None

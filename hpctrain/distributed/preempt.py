"""Stop requests from Slurm (preemption, time limit), agreed by every rank at a step boundary.

Slurm and submitit deliver signals to each task on its own: USR2 (submitit's requeue signal,
`--signal=USR2@signal_delay_s` before the time limit, or `job._interrupt()`), and SIGTERM
(preemption, scancel, a time limit without --signal). A handler only records the signal; the
trainer calls `agreed(step)` after each step, which all-reduces the recorded code with MAX, so
every rank stops after the same step, saves one consistent checkpoint with the others, and
leaves. Requeueing happens afterwards, outside any collective (`requeue_if_asked`).

Local runs (`launch.local`) install the same handlers plus SIGINT: Ctrl-C (which the terminal
sends to the launcher and every rank) or a SIGINT/SIGTERM the launcher forwards stops the ranks
through this same agreed path; a second SIGINT ends the process at once.

Codes: 0 nothing, 1 SIGTERM (save and exit), 2 USR2 (save, exit and requeue).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

NONE, TERM, REQUEUE = 0, 1, 2
_CODES = {signal.SIGTERM: TERM, signal.SIGUSR2: REQUEUE, signal.SIGINT: TERM}
SLURM_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
LOCAL_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)


class StopRequest:
    """Process-wide record of stop signals (a signal reaches a process, not an object)."""

    def __init__(self) -> None:
        self.code = NONE  # strongest signal seen by this process
        self.agreed = NONE  # the world's MAX, once agreed at a step boundary
        self.signum: int | None = None  # the first stop signal this process received
        self.installed = False
        self.previous: dict[int, Callable | int | None] = {}

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.code > NONE:
            log.warning("second SIGINT: exiting now, without a checkpoint")
            os._exit(128 + signal.SIGINT)
        self.code = max(self.code, _CODES.get(signum, TERM))
        self.signum = self.signum or signum
        log.warning("received %s: stopping with a checkpoint after this step",
                    signal.Signals(signum).name)

    def install(self, signals: tuple[int, ...] = SLURM_SIGNALS) -> None:
        """Replace the handlers of `signals` (submitit's USR2/SIGTERM ones are kept in
        `previous` for the requeue)."""
        for signum in signals:
            self.previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        self.installed = True

    def uninstall(self) -> None:
        """Put the previous handlers back and forget the signals seen (an in-process run that
        returns to its caller)."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self.previous.clear()
        self.code = self.agreed = NONE
        self.signum, self.installed = None, False

    def agreed_code(self, *, group: dist.ProcessGroup, device: torch.device) -> int:
        """Collective over `group` (the mesh's world): the MAX of every rank's code.
        Without installed handlers (a mesh used outside a launcher) no rank can be signalled:
        no collective."""
        if not self.installed:
            return NONE
        flag = torch.tensor([self.code], dtype=torch.int32, device=device)  # NCCL: on the GPU
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self.agreed = int(flag.item())
        return self.agreed


STOP = StopRequest()


def stop_agreed(*, group: dist.ProcessGroup, device: torch.device) -> bool:
    """True on every rank of `group` (the world) when any rank was signalled (call it at the
    same step everywhere)."""
    return STOP.agreed_code(group=group, device=device) > NONE


def requeue_if_asked(*, rank: int, grace_s: float = 3.0) -> bool:
    """After the stop checkpoint: rank 0 requeues the job when USR2 was seen.

    Preemption through submitit sends SIGTERM and then USR2; when only SIGTERM has arrived we
    wait `grace_s` for the USR2 that usually follows. A SIGTERM alone (scancel) never requeues.
    Under submitit its own handler requeues (it dumps the launcher's `checkpoint()`, a
    DelayedSubmission of the same call, runs `scontrol requeue` and exits this process);
    under plain sbatch we run `scontrol requeue` ourselves. Returns True if requeued.
    """
    if STOP.agreed == NONE or rank != 0:
        return False
    deadline = time.monotonic() + grace_s
    while STOP.code < REQUEUE and STOP.agreed < REQUEUE and time.monotonic() < deadline:
        time.sleep(0.1)
    if max(STOP.code, STOP.agreed) < REQUEUE:
        log.info("stopped on SIGTERM: checkpoint saved, not requeueing")
        return False
    handler = STOP.previous.get(signal.SIGUSR2)
    if callable(handler) and getattr(handler, "__self__", None) is not None:
        log.info("checkpoint saved: requeueing through submitit")
        handler(signal.SIGUSR2, None)  # submitit requeues, then sys.exit(-1)
        return True
    job_id = os.environ["SLURM_JOB_ID"]
    log.info("checkpoint saved: scontrol requeue %s", job_id)
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    return True

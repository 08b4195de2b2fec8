"""Point-to-point helpers for the pipeline: tagged non-blocking send, blocking receive, and a
courier thread that issues them off the caller's critical path.

On gloo, `batch_isend_irecv` is reported unreliable, so each message is one `isend` with a tag
that identifies it uniquely, matched by one `irecv` with the same tag. Sends are kept
(`Outbox`) until `wait_all`, because a tensor must stay alive until its send completes.
Every wait takes the mesh's timeout explicitly: a peer that never answers raises after it.

Why a courier: on gloo/TCP an `isend` or `irecv` call costs ~35–130 µs of the calling thread
(the socket write and the peer's wake-up happen inside it; profiled on 2 CPU ranks), and a
pipeline rank issues one per cross-rank hop. Made on the compute thread, that time is pipeline
bubble. The courier makes them on one background thread in FIFO order while the caller
computes (torch ops and c10d calls release the GIL); the caller only enqueues.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

MESSAGE_KINDS = ("F", "B")  # activations forward, gradients backward


def message_tag(kind: str, *, stage: int, microbatch: int, n_stages: int) -> int:
    """A unique non-negative tag for (kind, receiving stage, microbatch).

    tag = (microbatch · n_stages + stage) · 2 + kind_index, so no two messages of one step share
    a tag and a mismatched pair fails instead of delivering the wrong tensor.
    """
    if kind not in MESSAGE_KINDS:
        raise ValueError(f"message kind {kind!r} is not one of {MESSAGE_KINDS}")
    return (microbatch * n_stages + stage) * len(MESSAGE_KINDS) + MESSAGE_KINDS.index(kind)


class Courier:
    """One background thread that runs submitted calls in submission order.

    `submit(fn)` returns a `Job` at once (a queue put, ~3 µs; a ThreadPoolExecutor costs
    ~17 µs); `fn` must not block (isend/irecv return their Work immediately), so a job not done
    within the timeout means the thread is stuck. The thread is a daemon that sleeps on its
    queue; `close()` ends it after the calls already submitted.
    """

    def __init__(self, *, timeout: datetime.timedelta):
        self.timeout = timeout
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="hpctrain-p2p", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def submit(self, fn: Callable[[], object]) -> Job:
        modes = _get_current_dispatch_mode_stack()  # thread-local: carried to the courier
        job = Job(fn if not modes else functools.partial(_under_modes, modes, fn))
        self._jobs.put(job)
        return job

    def result(self, job: Job, *, what: str):
        """The call's result; re-raises its error; RuntimeError naming `what` after the
        timeout."""
        if not job.done.acquire(timeout=self.timeout.total_seconds()):
            raise RuntimeError(f"the p2p courier did not issue {what} within {self.timeout}: "
                               "its thread is stuck; raise cluster.timeout_s if the host is "
                               "overloaded")
        job.done.release()  # stays done for a second reader
        if job.error is not None:
            raise job.error
        return job.value

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(self.timeout.total_seconds())


def _under_modes(modes, fn: Callable[[], object]) -> object:
    """`fn` under the submitting thread's dispatch modes (e.g. the dry run's collective tally,
    hpctrain.tasks.dryrun.comm), which torch keeps per thread."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        return fn()


class Job:
    """A call submitted to a `Courier`: `done` is held until it ran; then `value` or `error`."""

    __slots__ = ("fn", "done", "value", "error")

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.value, self.error = fn, None, None
        self.done = threading.Lock()
        self.done.acquire()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            self.error = e
        finally:
            self.done.release()


class Outbox:
    """Outstanding isends of one step: keeps their tensors alive until `wait_all`. With a
    `courier`, the isend calls are made on its thread (module docstring says why)."""

    def __init__(self, *, timeout: datetime.timedelta, courier: Courier | None = None):
        self.timeout = timeout
        self.courier = courier
        self._works: list[tuple[dist.Work | Job, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, *, dst: int, tag: int) -> None:
        """Non-blocking send of a contiguous copy of `tensor` to global rank `dst`."""
        payload = tensor.detach().contiguous()
        if self.courier is None:
            self._works.append((dist.isend(payload, dst=dst, tag=tag), payload))
        else:
            work = self.courier.submit(lambda: dist.isend(payload, dst=dst, tag=tag))
            self._works.append((work, payload))

    def wait_all(self) -> None:
        for work, _ in self._works:
            if isinstance(work, Job):
                work = self.courier.result(work, what="a send")
            work.wait(self.timeout)
        self._works.clear()


def recv(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device, src: int,
         tag: int, timeout: datetime.timedelta) -> torch.Tensor:
    """Blocking receive of a tensor of known shape/dtype from global rank `src`; raises when
    nothing arrives within `timeout`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.irecv(out, src=src, tag=tag).wait(timeout)
    return out

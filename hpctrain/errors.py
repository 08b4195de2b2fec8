"""Exceptions that end a run on purpose: one message, a chosen exit code, no traceback.

A rank raises a `RunStopped` when the run must stop and every rank agrees (they all raise it
at the same step); the launcher carries the message to the entry point, which logs it as one
line and exits with `exit_code`. Anything else that escapes a rank is a bug and keeps its
traceback.
"""

from __future__ import annotations

import logging
import os
import sys


class RunStopped(RuntimeError):
    """The run stopped for a reason the message explains (with the fix)."""

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NonFiniteError(RunStopped):
    """A non-finite loss, gradient norm or checkpoint state stopped training."""

    exit_code = 3


def end_process(code: int) -> None:
    """Exit with `code` after the message is out, skipping the interpreter's teardown: a rank's
    process-group and watchdog threads destroyed during that teardown can abort the process
    ("terminate called without an active exception", status -6) and replace the intended
    exit code. Every log handler and stdio stream is flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

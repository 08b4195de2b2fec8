"""Exceptions that end a run on purpose: one message, a chosen exit code, no traceback.

A rank raises a `RunStopped` when the run must stop and every rank agrees (they all raise it
at the same step); the launcher carries the message to the entry point, which logs it as one
line and exits with `exit_code`. Anything else that escapes a rank is a bug and keeps its
traceback.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any


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


def read_json(path: str | os.PathLike, *, fix: str) -> Any:
    """A user's JSON file; ValueError naming the file, where it breaks, and `fix` (a bare
    JSONDecodeError names neither the file nor what to do)."""
    try:
        return json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): {fix}") from None


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


# A storage that refuses writes: full, over quota, read-only, not permitted.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def storage_stop(err: OSError, *, where: str | os.PathLike | None = None) -> RunStopped | None:
    """A write the storage refused (`STORAGE_ERRNOS`) as one message naming the path (the
    error's, else `where`: the directory being written), the free space and the fix; None for
    any other OSError (a bug or a fault to report as it is). Permission errors may come from
    a read as well: they say "cannot access" and ask for permissions."""
    if err.errno not in STORAGE_ERRNOS:
        return None
    named = err.filename or where
    path = Path(os.path.expanduser(named)) if named else None
    free = ""
    try:  # the nearest existing directory's filesystem (exists() itself may be refused)
        probe = path
        while probe is not None and not os.path.exists(probe) and probe != probe.parent:
            probe = probe.parent
        if probe is not None:
            free = f" ({shutil.disk_usage(probe).free / 1e6:.1f} MB free on its filesystem)"
    except OSError:
        pass
    if err.errno in (errno.EACCES, errno.EPERM):
        return RunStopped(f"cannot access {path or 'a file'}: {err.strerror}. Give this user "
                          "read and write permission there, or choose another directory "
                          "(hydra.run.dir=<dir>, data.cache_dir=<dir>), then run the same "
                          "command again")
    what = str(path) if err.filename else f"into {path}" if path else "a file"
    return RunStopped(f"cannot write {what}: {err.strerror}{free}. Free space or make the "
                      "directory writable, or choose another one (hydra.run.dir=<dir>, "
                      "data.cache_dir=<dir>), then run the same command again: the checkpoints "
                      "already saved are intact and a rerun resumes from the newest")


PATH_ERRNOS = (errno.ELOOP, errno.ENOTDIR, errno.EEXIST, errno.ENOENT)


def path_stop(err: OSError) -> RunStopped | None:
    """A directory that cannot be made where it is asked for — a dangling or looping
    symlink, a file in the way — as one message naming the path; None for other errors."""
    if err.errno not in PATH_ERRNOS or not err.filename:
        return None
    path = Path(os.fsdecode(err.filename))
    why = err.strerror
    blocker = next((p for p in (path, *path.parents)
                    if p.exists() and not p.is_dir() and not p.is_symlink()), None)
    if blocker is not None:
        return RunStopped(f"cannot use {path}: {blocker} is a file where a directory must be. "
                          "Move or delete it, or choose another directory (hydra.run.dir=<dir>), "
                          "then run the command again (checkpoints already saved are intact)",
                          exit_code=2)
    if path.is_symlink():
        fault = "does not exist"
        try:
            path.resolve(strict=True)
        except RuntimeError:  # Python < 3.13: a loop
            fault = "loops back to itself"
        except OSError as found:
            fault = "loops back to itself" if found.errno == errno.ELOOP else fault
        why = f"a symbolic link to {os.readlink(path)}, which {fault}"
    return RunStopped(f"cannot use {path} as a directory: {why}. Remove or fix it, or choose "
                      "another directory (hydra.run.dir=<dir>), then run the command again",
                      exit_code=2)


class OnceFileHandler(logging.FileHandler):
    """A log file that stops on its first failed write (a full or read-only disk) with one
    line on stderr, instead of a traceback for every record that follows; other errors of a
    record (a bad format string) are logging's usual report and change nothing."""

    broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        err = sys.exc_info()[1]
        if isinstance(err, OSError):
            self._fail(err)
        else:
            super().handleError(record)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as err:  # what the disk refused stays unwritten; the run goes on
            self._fail(err)

    def close(self) -> None:
        try:
            super().close()
        except OSError as err:
            self._fail(err)

    def _fail(self, err: OSError) -> None:
        if self.broken:
            return
        self.broken = True
        try:
            sys.stderr.write(f"hpctrain: the log file {self.baseFilename} cannot be written "
                             f"({err}): logging to the terminal only\n")
        except (OSError, ValueError):
            pass

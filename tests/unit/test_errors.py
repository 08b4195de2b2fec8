"""The storage errors' one message and a log file that fails once, quietly."""

from __future__ import annotations

import errno
import logging

from hpctrain.errors import OnceFileHandler, storage_stop


def test_a_refused_write_names_path_and_free_space_a_refused_access_asks_for_permission(
        tmp_path):
    full = storage_stop(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x")))
    assert str(full).startswith(f"cannot write {tmp_path / 'x'}: No space left on device (")
    assert "MB free on its filesystem)" in str(full) and full.exit_code == 1
    into = storage_stop(OSError(errno.ENOSPC, "No space left on device"), where=tmp_path / "a/b")
    assert str(into).startswith(f"cannot write into {tmp_path / 'a/b'}: No space")
    denied = storage_stop(PermissionError(errno.EACCES, "Permission denied", "/data/corpus"))
    assert str(denied).startswith("cannot access /data/corpus: Permission denied. Give this "
                                  "user read and write permission there")
    assert storage_stop(FileNotFoundError(errno.ENOENT, "No such file", "/x")) is None
    assert storage_stop(OSError("Hydra's MissingConfigException has no errno")) is None


def test_a_log_file_on_a_full_disk_stops_once_and_closes_quietly(capsys):
    handler = OnceFileHandler("/dev/full", mode="a")  # every write: ENOSPC
    logger = logging.getLogger("test.oncefile")
    logger.propagate = False  # pytest's own capture handler is not under test
    logger.addHandler(handler)
    try:
        for i in range(3):
            logger.warning("line %d", i)
    finally:
        logger.removeHandler(handler)
    handler.close()  # buffered bytes the disk refused: no exception
    err = capsys.readouterr().err
    assert err.count("cannot be written") == 1 and "Traceback" not in err, err
    assert handler.broken


def test_a_bad_record_does_not_silence_the_log_file(tmp_path, capsys):
    handler = OnceFileHandler(tmp_path / "run.log", mode="a")
    logger = logging.getLogger("test.oncefile.fmt")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning("%d", "not a number")  # logging's own report, on stderr
        logger.warning("still written")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert not handler.broken and "still written" in (tmp_path / "run.log").read_text()

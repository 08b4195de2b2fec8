"""Read the records of an offline W&B run file (`run-<id>.wandb`) for tests.

The file is a 7-byte header (':W&B', magic, version) followed by a LevelDB-style log: 32 KiB
blocks of chunks, each chunk a 7-byte header (crc32c, length, type FULL/FIRST/MIDDLE/LAST)
and its bytes; the payloads are serialized `wandb_internal_pb2.Record` messages.

W&B's own process writes the file and may still be writing it when the run has returned (seen
on a loaded 2-core machine: a test read a truncated last chunk), so `records` reads until the
run's `exit` record is there (up to WAIT_S), never a chunk the file does not yet hold whole.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
WAIT_S = 60.0


def raw_records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, out, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        space = BLOCK - pos % BLOCK
        if space < HEADER:
            pos += space
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if pos + HEADER + length > len(data):
            break  # the writer has not finished this chunk yet
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            break
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    return out


def _parsed(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for raw in raw_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def records(path: Path) -> list:
    """The file's records, once W&B has written the run's `exit` record (or WAIT_S passed)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        got = _parsed(path)
        if any(r.WhichOneof("record_type") == "exit" for r in got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def history(path: Path) -> list[dict[str, str]]:
    """The logged rows: {key: json value} per W&B history record."""
    return [{item.key or "/".join(item.nested_key): item.value_json
             for item in rec.history.item}
            for rec in records(path) if rec.WhichOneof("record_type") == "history"]


def run_ids(path: Path) -> set[str]:
    return {rec.run.run_id for rec in records(path) if rec.WhichOneof("record_type") == "run"}


def config_keys(path: Path) -> set[str]:
    keys = set()
    for rec in records(path):
        if rec.WhichOneof("record_type") == "config":
            keys |= {item.key for item in rec.config.update}
        if rec.WhichOneof("record_type") == "run":
            keys |= {item.key for item in rec.run.config.update}
    return keys

"""One work unit of prepare: a run of inputs (files or byte ranges of a plain JSON Lines file)
tokenised into one shard, streaming.

A shard is `<n>.bin` (the framed documents' token ids, little-endian uint16 or uint32),
`<n>.idx` (int64 offsets of its eod tokens) and `<n>.json` (its statistics, written last: a
shard with a .json is finished, and a resumed prepare keeps it). A shard depends only on its
unit, so the whole output is the same whatever the number of worker processes. Memory is
bounded by one document plus `FLUSH_TOKENS` buffered ids.

This module imports neither torch nor hpctrain.config.schema: worker processes start fast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hpctrain.data.records import Record, records
from hpctrain.data.tokenizer import TokenizerSpec, load

log = logging.getLogger(__name__)
FLUSH_TOKENS = 1 << 20


Input = tuple[str, int, int | None]  # path, first byte, end byte (None: the file's end)


def input_bytes(item: Input) -> int:
    path, start, stop = item
    return (os.path.getsize(path) if stop is None else stop) - start


@dataclass(frozen=True)
class Unit:
    """Inputs (path, start, stop: a byte range, stop None for the end) → shard `index`."""

    index: int
    files: tuple[Input, ...]
    out_dir: str
    fmt: str
    text_key: str
    on_bad_record: str  # error | skip
    tokenizer: TokenizerSpec
    dtype: str  # uint16 | uint32

    @property
    def stem(self) -> Path:
        return Path(self.out_dir) / f"{self.index:05d}"


@dataclass
class ShardStats:
    documents: int = 0
    tokens: int = 0
    empty: int = 0  # empty records, skipped
    bad: int = 0  # bad records skipped (data.on_bad_record=skip)
    input_bytes: int = 0
    max_id: int = -1
    sha256: str = ""
    bad_examples: list[str] = field(default_factory=list)

    def add(self, other: ShardStats) -> None:
        for key in ("documents", "tokens", "empty", "bad", "input_bytes"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.max_id = max(self.max_id, other.max_id)
        self.bad_examples = (self.bad_examples + other.bad_examples)[:5]


def finished(unit: Unit) -> ShardStats | None:
    """The statistics of a shard already written (a resumed prepare), else None."""
    meta = unit.stem.with_suffix(".json")
    if not meta.is_file():
        return None
    return ShardStats(**json.loads(meta.read_text()))


def write_shard(unit: Unit) -> ShardStats:
    """Tokenise `unit` into its shard (module doc) and return its statistics. A bad record
    raises ValueError naming the file, the line or row and the fix (data.on_bad_record=error)
    or is skipped and counted (skip)."""
    done = finished(unit)
    if done is not None:
        return done
    encoder, stats = load(unit.tokenizer), ShardStats()
    sink = _Sink(unit.stem, np.dtype(unit.dtype), eod=encoder.eod_id)
    for path, start, stop in unit.files:
        stats.input_bytes += input_bytes((path, start, stop))
        for rec in records(Path(path), unit.fmt, text_key=unit.text_key, start=start,
                           stop=stop):
            text = _usable(rec, Path(path), unit, stats, wants_text=encoder.wants_text)
            if text is None:
                continue
            ids = encoder.frame(text)
            sink.append(ids)
            stats.documents += 1
            stats.max_id = max(stats.max_id, int(ids.max()))
    stats.tokens, stats.sha256 = sink.close()
    unit.stem.with_suffix(".json").write_text(json.dumps(asdict(stats)))
    return stats


def _usable(rec: Record, path: Path, unit: Unit, stats: ShardStats, *, wants_text: bool):
    """The record's text, or None when it is empty (counted) or bad (raised or counted)."""
    text, problem = rec.text, rec.problem
    if problem is None and wants_text and isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            problem = f"not UTF-8 (byte {err.start})"
    if problem is None:
        if not text:
            stats.empty += 1
            return None
        return text
    if unit.on_bad_record == "skip":
        stats.bad += 1
        if len(stats.bad_examples) < 5:
            stats.bad_examples.append(f"{path} ({rec.where or 'whole file'}): {problem}")
        return None
    raise ValueError(f"bad record in {path} ({rec.where or 'whole file'}): {problem}: fix or "
                     "remove it, or set data.on_bad_record=skip to skip and count bad records")


class _Sink:
    """Buffered writer of one shard's tokens and document index, hashing what it writes."""

    def __init__(self, stem: Path, dtype: np.dtype, *, eod: int):
        self.stem, self.dtype, self.eod = stem, dtype.newbyteorder("<"), eod
        self.tmp = stem.with_name(f"{stem.name}.bin.tmp{os.getpid()}")
        self.idx_tmp = stem.with_name(f"{stem.name}.idx.tmp{os.getpid()}")
        self.f, self.idx = open(self.tmp, "wb"), open(self.idx_tmp, "wb")  # noqa: SIM115
        self.hash, self.buf, self.buffered, self.written = hashlib.sha256(), [], 0, 0

    def append(self, ids: np.ndarray) -> None:
        self.buf.append(ids.astype(self.dtype))
        self.buffered += len(ids)
        if self.buffered >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self.buf:
            chunk = np.concatenate(self.buf)
            data = chunk.tobytes()
            self.f.write(data)
            self.hash.update(data)
            # every eod token is a document end (hpctrain.data.packing), as the index reads it
            self.idx.write((np.flatnonzero(chunk == self.eod) + self.written).astype("<i8")
                           .tobytes())
            self.written += len(chunk)
        self.buf, self.buffered = [], 0

    def close(self) -> tuple[int, str]:
        """Finish the shard: its .bin and .idx under their names; (tokens, sha256)."""
        self._flush()
        self.f.close()
        self.idx.close()
        self.idx_tmp.replace(self.stem.with_suffix(".idx"))
        self.tmp.replace(self.stem.with_suffix(".bin"))
        return self.written, self.hash.hexdigest()

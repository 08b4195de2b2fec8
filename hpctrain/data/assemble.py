"""The last step of prepare: finished shards → `train.bin`/`val.bin`, their document indexes
and the manifest's file entries, streaming (bounded memory: `CHUNK_TOKENS` ids at a time).

A `Stream` is a run of shards read as one token sequence. A split is a list of segments
(stream, lo, hi): tokens [lo, hi) of the stream, written one after the other. Without a
mixture the train split is [0, n_train) of the one stream and val the rest (as the single-file
prepare always split it); with data.val_paths val is its own stream; a mixture repeats or cuts
each corpus's stream (hpctrain.data.mixture). `<split>.idx` holds the offsets of the split's eod
tokens (hpctrain.data.packing). Every file's entry records its size in bytes, sha256 and, for
token files, the token count and largest token id, so a copy can be verified.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK_TOKENS = 1 << 24


@dataclass(frozen=True)
class Stream:
    """Shards (path stems of <n>.bin/.idx) read as one sequence; `sizes`: tokens of each."""

    stems: tuple[Path, ...]
    sizes: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.sizes)

    def ends(self) -> np.ndarray:
        """Offsets (in the stream) of its eod tokens, from the shards' indexes."""
        starts = np.cumsum((0, *self.sizes[:-1]))
        parts = [np.fromfile(s.with_suffix(".idx"), dtype="<i8") + a
                 for s, a in zip(self.stems, starts, strict=True)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


Segment = tuple[Stream, int, int]


class _Out:
    """One output file being written: its hash, size, token count and largest id."""

    def __init__(self, path: Path):
        self.path, self.f = path, open(path, "wb")  # noqa: SIM115 - closed in done()
        self.hash, self.tokens, self.max_id, self.bytes = hashlib.sha256(), 0, -1, 0

    def write(self, array: np.ndarray, *, tokens: bool) -> None:
        data = array.tobytes()
        self.f.write(data)
        self.hash.update(data)
        self.bytes += len(data)
        if tokens and len(array):
            self.tokens += len(array)
            self.max_id = max(self.max_id, int(array.max()))

    def done(self, *, tokens: bool) -> dict:
        self.f.close()
        entry = {"bytes": self.bytes, "sha256": self.hash.hexdigest()}
        if tokens:
            entry.update(tokens=self.tokens, max_id=self.max_id)
        else:
            entry.update(documents=self.bytes // 8)
        return entry


def assemble(plan: dict[str, list[Segment]], out_dir: Path, *, dtype: str) -> dict:
    """Write train/val .bin and .idx into `out_dir` from `plan` (split → segments); return
    the files' entries (name → bytes, sha256, tokens and max_id or documents)."""
    entries = {}
    for split in ("train", "val"):
        bin_out, idx_out = _Out(out_dir / f"{split}.bin"), _Out(out_dir / f"{split}.idx")
        at = 0  # tokens written to this split so far
        for stream, lo, hi in plan[split]:
            _copy(stream, lo, hi, bin_out, idx_out, at=at, dtype=np.dtype(dtype))
            at += hi - lo
        entries[f"{split}.bin"] = bin_out.done(tokens=True)
        entries[f"{split}.idx"] = idx_out.done(tokens=False)
    return entries


def _copy(stream: Stream, lo: int, hi: int, bin_out: _Out, idx_out: _Out, *, at: int,
          dtype: np.dtype) -> None:
    """Tokens [lo, hi) of `stream` (and their eod offsets, moved to `at`) to the outputs."""
    start = 0  # the current shard's first token in the stream
    for stem, size in zip(stream.stems, stream.sizes, strict=True):
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            tokens = np.memmap(stem.with_suffix(".bin"), dtype=dtype.newbyteorder("<"),
                               mode="r")
            for c in range(a - start, b - start, CHUNK_TOKENS):
                bin_out.write(np.asarray(tokens[c:min(c + CHUNK_TOKENS, b - start)]),
                              tokens=True)
            del tokens
            ends = np.fromfile(stem.with_suffix(".idx"), dtype="<i8") + start
            ends = ends[(ends >= a) & (ends < b)]
            idx_out.write((ends - lo + at).astype("<i8"), tokens=False)
        start += size

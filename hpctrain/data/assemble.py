"""The last step of prepare: finished shards → `train.bin`/`val.bin`, their document indexes
and `manifest.json`, streaming (bounded memory: one chunk of `CHUNK_TOKENS` ids at a time).

The token stream is the shards in order; the last `val_tokens` of it are the val split (as the
single-file prepare always split it). `<split>.idx` holds the offsets of the split's eod tokens
(hpctrain.data.packing). The manifest records for every file its size in bytes, sha256 and, for
token files, the token count and largest token id, so a copy can be verified.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

CHUNK_TOKENS = 1 << 24


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


def assemble(shard_stems: list[Path], out_dir: Path, *, dtype: str, n_train: int) -> dict:
    """Write train/val .bin and .idx into `out_dir` from the shards; return the manifest's
    `files` entries (name → bytes, sha256, tokens and max_id or documents)."""
    outs = {name: _Out(out_dir / name) for name in ("train.bin", "val.bin", "train.idx",
                                                    "val.idx")}
    start = 0  # global offset of the current shard
    for stem in shard_stems:
        tokens = _tokens(stem.with_suffix(".bin"), np.dtype(dtype).newbyteorder("<"))
        for lo in range(0, len(tokens), CHUNK_TOKENS):
            _split_write(tokens[lo:lo + CHUNK_TOKENS], start + lo, n_train, outs, tokens=True)
        offsets = np.fromfile(stem.with_suffix(".idx"), dtype="<i8") + start
        _split_write(offsets, None, n_train, outs, tokens=False)
        start += len(tokens)
        del tokens
    return {name: out.done(tokens=name.endswith(".bin")) for name, out in outs.items()}


def _tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _split_write(values: np.ndarray, at: int | None, n_train: int, outs: dict, *,
                 tokens: bool) -> None:
    """Tokens starting at global offset `at` (or index offsets, tokens=False) into train/val."""
    ext = "bin" if tokens else "idx"
    if tokens:
        cut = max(0, min(len(values), n_train - at))
        train, val = values[:cut], values[cut:]
    else:
        train, val = values[values < n_train], (values[values >= n_train] - n_train)
        val = val.astype("<i8")
    outs[f"train.{ext}"].write(train, tokens=tokens)
    outs[f"val.{ext}"].write(val, tokens=tokens)

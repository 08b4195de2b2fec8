"""Dynamic batching (train.batching=tokens): whole documents packed into rows with little padding.

Legend: B rows, L = train.seq_len. The token stream t_0..t_{N-1} holds documents each closed by
the end-of-document token (eod). In (input, target) pairs — pair i is (t_i, t_{i+1}) — document j
is the pairs [c_j, c_{j+1}) with c = {0} ∪ {eod offsets} ∪ {N−1}: its inputs start with the
previous document's eod (a beginning-of-document token) and its targets end with its own eod, so
it is exactly the document trained alone. A document longer than L is cut into pieces of ≤ L
pairs (each its own document: positions restart, as a row would cut it).

Packing is best-fit decreasing by length (the length buckets: pieces are taken longest first,
each into the fullest row it still fits), computed once from the document index, so the rows are a
fixed list — a pure function of the data. The sampler then permutes rows per epoch by
(seed, epoch) as it does for windows, so a step's rows are a pure function of (seed, step):
resume is bit-identical, and at another dp size the global stream is unchanged. Padding (after
the last piece of a row) has inputs eod, targets IGNORE_INDEX (no loss) and its own document id
(no attention into or out of it). A micro-batch keeps the fixed shape B × L, which pipeline
stages need; its token budget is B·L.

The document index (offsets of the eod tokens of a split) is `<split>.idx` beside the tokens,
built once (prepare writes it; an older cache gets it on first use) and verified on load: the
count must match and every offset must hold the eod token.

A mixture's corpora (hpctrain.data.sources.Source) are packed apart: a piece belongs to the
corpus whose range holds its targets, and a row holds one corpus only, so the sampler can pick
the corpus of every row.
"""

from __future__ import annotations

import bisect
import logging
import os
from pathlib import Path

import numpy as np
import torch

from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.data.sources import Source, numbered
from hpctrain.ops.documents import IGNORE_INDEX, Documents

log = logging.getLogger(__name__)


def build_document_index(tokens: np.ndarray, *, eod: int) -> np.ndarray:
    """Offsets (int64, increasing) of every eod token in `tokens`."""
    return np.flatnonzero(np.asarray(tokens) == eod).astype(np.int64)


def write_document_index(path: Path, offsets: np.ndarray) -> None:
    """Write `offsets` to `path` atomically (temporary name, then rename)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    offsets.astype(np.int64).tofile(tmp)
    tmp.replace(path)


def load_document_index(directory: Path, split: str, tokens: np.ndarray, *, eod: int,
                        count: int | None = None) -> np.ndarray:
    """The verified document index of `split`, built (and cached) if missing.

    `count`: the split's number of eod tokens as prepare recorded it in meta.json (None: count
    them, one pass over the tokens). Raises ValueError naming the file when the index disagrees
    with the tokens (another count, an offset out of order or not holding eod): delete it and it
    is rebuilt."""
    path = directory / f"{split}.idx"
    if not path.exists():
        log.info("building the document index %s", path)
        write_document_index(path, build_document_index(tokens, eod=eod))
    offsets = np.fromfile(path, dtype=np.int64)
    if count is None:
        count = int(np.count_nonzero(np.asarray(tokens) == eod))
    bad = (len(offsets) != count or (len(offsets) and (offsets[-1] >= len(tokens)
           or np.any(np.diff(offsets) <= 0) or np.any(tokens[offsets] != eod))))
    if bad:
        raise ValueError(f"document index {path} does not match {directory}/{split}.bin "
                         f"({len(offsets)} offsets, {count} end-of-document tokens): delete "
                         f"{path} and it is rebuilt on the next run")
    return offsets


def document_pieces(offsets: np.ndarray, *, n_tokens: int, max_len: int,
                    cuts: tuple[int, ...] = ()) -> np.ndarray:
    """(start, length) pair ranges, one per document piece of ≤ max_len pairs (module doc);
    `cuts`: more pair offsets where a piece must end (the ends of a mixture's corpora)."""
    extra = np.asarray([c for c in cuts if 0 < c < n_tokens - 1], dtype=np.int64)
    cuts = np.unique(np.concatenate([[0], offsets[offsets < n_tokens - 1], extra,
                                     [n_tokens - 1]]))
    starts, lengths = [], []
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        for s in range(a, b, max_len):
            starts.append(s)
            lengths.append(min(max_len, b - s))
    return np.stack([np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)], 1)


def pack_rows(lengths: np.ndarray, *, row_len: int) -> list[list[int]]:
    """Best-fit decreasing: piece indices per row, each row's lengths summing to ≤ row_len.
    Deterministic (ties broken by piece index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted: best fit = first with room
    for i in order:
        n = int(lengths[i])
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([i])
            room, row = row_len - n, len(rows) - 1
        else:
            room, row = free.pop(at)
            rows[row].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


class PackedDocuments:
    """Rows of seq_len (input, target) pairs filled with whole documents (module doc).

    Same interface as `TokenDataset` for the sampler: `n_samples` rows, `rows(indices)`."""

    def __init__(self, directory: Path, split: str, *, seq_len: int, tokens: np.ndarray,
                 eod: int, count: int | None = None, sources: list[Source] | None = None):
        self.tokens, self.eod, self.seq_len = tokens, eod, seq_len
        offsets = load_document_index(directory, split, tokens, eod=eod, count=count)
        ends = tuple(s.hi - 1 for s in sources or [])  # a corpus's last pair ends at hi − 2
        self.pieces = document_pieces(offsets, n_tokens=len(tokens), max_len=seq_len, cuts=ends)
        groups = [np.arange(len(self.pieces))]
        if sources:  # piece → the corpus holding its targets [start+1, start+length]
            owner = np.searchsorted(np.asarray(ends), self.pieces[:, 0], side="right")
            groups = [np.flatnonzero(owner == i) for i in range(len(sources))]
        self.packed, counts = [], []
        for group in groups:
            rows = pack_rows(self.pieces[group, 1], row_len=seq_len)
            self.packed += [[int(group[k]) for k in row] for row in rows]
            counts.append(len(rows))
        self.sources = sources and numbered(sources, counts, where=f"{directory}/{split}.bin",
                                            need="a row of documents")
        self.n_samples = len(self.packed)
        if self.n_samples < 1:
            raise ValueError(f"{directory}/{split}.bin holds {len(tokens)} tokens: too few for "
                             f"one row of documents; add data or lower data.val_fraction")
        real = int(self.pieces[:, 1].sum())
        self.padding_fraction = 1.0 - real / (self.n_samples * seq_len)

    def real_tokens(self, index: int) -> int:
        """Targets of row `index` that count in the loss (its pieces; padding does not)."""
        return int(self.pieces[self.packed[index], 1].sum())

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """inputs_L, targets_L, document ids_L of packed row `index`."""
        L = self.seq_len
        inputs = np.full(L, self.eod, dtype=np.int64)
        targets = np.full(L, IGNORE_INDEX, dtype=np.int64)
        ids = np.full(L, len(self.packed[index]), dtype=np.int64)  # padding: one more document
        at = 0
        for k, piece in enumerate(self.packed[index]):
            start, n = (int(v) for v in self.pieces[piece])
            span = np.asarray(self.tokens[start:start + n + 1], dtype=np.int64)
            inputs[at:at + n], targets[at:at + n], ids[at:at + n] = span[:-1], span[1:], k
            at += n
        return inputs, targets, ids

    def rows(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, Documents]:
        """inputs_BL, targets_BL (IGNORE_INDEX on padding) and the rows' documents."""
        parts = [self.row(i) for i in indices]
        inputs, targets, ids = (torch.from_numpy(np.stack(p)) for p in zip(*parts, strict=True))
        return inputs, targets, Documents.from_ids(ids)


@check("train.batching", "data.packing")
def check_packing(c: Config) -> list[str]:
    if c.train.batching == "tokens" and c.data.packing != "documents":
        return [f"train.batching=tokens packs whole documents into padded rows, which needs "
                f"data.packing=documents, not data.packing={c.data.packing}: set "
                f"data.packing=documents or train.batching=rows"]
    return []

"""The corpora of a mixture within a prepared split (meta.json's "mixture": each corpus's token
range [lo, hi) in train.bin and val.bin), numbered as the datasets' samples."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """One corpus of a mixture in a split: tokens [lo, hi), samples [first, first + count)."""

    name: str
    lo: int
    hi: int
    first: int = 0
    count: int = 0


def split_sources(meta: dict, split: str) -> list[Source] | None:
    """The corpora of a mixture's split (None: one corpus, or a val split from data.val_paths)."""
    rows = meta.get("mixture") or []
    if not rows or any(split not in r for r in rows):
        return None
    return [Source(r["name"], *r[split]) for r in rows]


def numbered(sources: list[Source], counts: list[int], *, where: str, need: str) -> list[Source]:
    """`sources` with their sample ranges; ValueError naming a corpus without one sample."""
    out, first = [], 0
    fix = ("raise data.val_fraction, or give data.val_paths" if where.endswith("val.bin") else
           "lower data.val_fraction")
    for s, n in zip(sources, counts, strict=True):
        if n < 1:
            raise ValueError(f"corpus {s.name!r} holds {s.hi - s.lo} tokens in {where}, too few "
                             f"for one sample ({need}): give it more data, {fix}, or lower "
                             "train.seq_len")
        out.append(Source(s.name, s.lo, s.hi, first, n))
        first += n
    return out

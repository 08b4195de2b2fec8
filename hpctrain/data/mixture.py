"""Which tokens make up each split (the plans `hpctrain.data.assemble` writes), for one corpus
or a mixture of corpora (data.mixture).

Mixture: corpus i (a `Stream` of T_i tokens) keeps its last val_fraction for the val split (at
least one token; none when data.val_paths gives the val split), cut back to a document end so no
document straddles; the rest is its train part. The train split is the corpora's train parts
one after the other, each once, and the val split their val parts; meta.json records each
corpus's token range [lo, hi) in both. The weights are not part of the prepared data: the
sampler draws each sample's corpus by a seeded schedule (hpctrain.data.schedule), so other
weights or stages reuse the same files.
"""

from __future__ import annotations

import numpy as np

from hpctrain.data.assemble import Segment, Stream


def single_plan(stream: Stream, *, n_train: int, val: Stream | None = None
                ) -> dict[str, list[Segment]]:
    """One corpus: train is [0, n_train) of it, val the rest (or all of `val`)."""
    if val is not None:
        return {"train": [(stream, 0, stream.tokens)], "val": [(val, 0, val.tokens)]}
    return {"train": [(stream, 0, n_train)], "val": [(stream, n_train, stream.tokens)]}


def _doc_cut(ends: np.ndarray, limit: int) -> int:
    """The largest document end (offset after an eod) ≤ limit, else 0."""
    k = int(np.searchsorted(ends, limit - 1, side="right"))
    return int(ends[k - 1]) + 1 if k else 0


def mixture_plan(streams: list[Stream], *, val_fraction: float, val: Stream | None = None
                 ) -> tuple[dict[str, list[Segment]], list[dict]]:
    """The plan of a mixture (module doc) and, per corpus, its tokens and its ranges in the
    splits ("train": [lo, hi), and "val" unless `val` is given). ValueError when a corpus has
    no train tokens."""
    train, val_segments, report = [], [], []
    at = {"train": 0, "val": 0}
    for i, s in enumerate(streams):
        ends, total = s.ends(), s.tokens
        n_val = 0 if val is not None else min(total, max(1, int(total * val_fraction)))
        cut = _doc_cut(ends, total - n_val) or total - n_val
        if cut <= 0:
            raise ValueError(f"data.mixture[{i}] holds {total} tokens, none left for training "
                             "after its val part: add data to it or remove it")
        train.append((s, 0, cut))
        row = {"tokens": total, "train": [at["train"], at["train"] + cut]}
        at["train"] += cut
        if val is None:
            val_segments.append((s, cut, total))
            row["val"] = [at["val"], at["val"] + total - cut]
            at["val"] += total - cut
        report.append(row)
    return {"train": train, "val": [(val, 0, val.tokens)] if val else val_segments}, report

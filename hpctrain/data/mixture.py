"""Which tokens make up each split (the plans `hpctrain.data.assemble` writes), for one corpus
or a weighted mixture of corpora (data.mixture).

Mixture: corpus i (a `Stream` of T_i tokens) keeps its last val_fraction for the val split (at
least one token; none when data.val_paths gives the val split), cut back to a document end so no
document straddles; the rest, L_i tokens, is its train part. With W = Σ weights and
L = Σ L_i, corpus i contributes t_i = round(w_i / W · L) train tokens: its train part k_i =
⌊t_i / L_i⌋ times, then its first whole documents up to t_i − k_i·L_i tokens. The train split
keeps about L tokens, in the weights' proportions (up to one document per corpus); the
sampler then draws windows from all of it at random, so corpora mix in every batch. A pure
function of the data and the weights: the same mixture gives the same bytes.
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


def mixture_plan(streams: list[Stream], weights: list[float], *, val_fraction: float,
                 val: Stream | None = None) -> tuple[dict[str, list[Segment]], list[dict]]:
    """The plan of a mixture (module doc) and, per corpus, its tokens, train tokens written
    and share of the train split. ValueError when a corpus has no train tokens."""
    parts, val_segments = [], []
    for i, s in enumerate(streams):
        ends, total = s.ends(), s.tokens
        n_val = 0 if val is not None else min(total, max(1, int(total * val_fraction)))
        cut = _doc_cut(ends, total - n_val) or total - n_val
        if cut <= 0:
            raise ValueError(f"data.mixture[{i}] holds {total} tokens, none left for training "
                             "after its val part: add data to it or remove it")
        parts.append((s, ends, cut))
        if val is None:
            val_segments.append((s, cut, total))
    total_train, weight_sum = sum(cut for _, _, cut in parts), sum(weights)
    train, report = [], []
    for (s, ends, cut), w in zip(parts, weights, strict=True):
        target = round(w / weight_sum * total_train)
        copies, rest = divmod(target, cut)
        segments = [(s, 0, cut)] * copies + [(s, 0, _doc_cut(ends[ends < cut], rest))]
        train += [seg for seg in segments if seg[2] > seg[1]]
        report.append({"weight": w, "tokens": s.tokens, "train_tokens": copies * cut +
                       segments[-1][2]})
    written = sum(r["train_tokens"] for r in report)
    for r in report:
        r["share"] = r["train_tokens"] / max(written, 1)
    return {"train": train, "val": [(val, 0, val.tokens)] if val else val_segments}, report

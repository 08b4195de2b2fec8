"""Dynamic batching (train.batching=tokens): padding and documents per row at several token
budgets, on the default data (stdlib sources, byte-level, data.max_bytes default) and on the
same data cut into short documents (every file split at blank lines), with the packing time.

A budget of B tokens is one row of seq_len = B (micro_batch_size=1); windows
(train.batching=rows) never pad but cut documents anywhere, so the table also gives the share
of documents a window cuts.

    python benchmarks/bench_packing.py --out benchmarks/results/packing.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from hpctrain.config.schema import DataConfig
from hpctrain.data.packing import document_pieces, pack_rows
from hpctrain.data.prepare import prepare

BUDGETS = (512, 1024, 2048, 4096, 8192)


def short_documents(tokens: np.ndarray, *, eod: int) -> np.ndarray:
    """eod offsets of the stream cut also at every blank line (byte 10, 10): many short
    documents of varied length, as a corpus of paragraphs or chat turns would have."""
    blank = np.flatnonzero((tokens[:-1] == 10) & (tokens[1:] == 10)) + 1
    return np.union1d(np.flatnonzero(tokens == eod), blank)


def row_stats(offsets: np.ndarray, *, n_tokens: int, budget: int) -> dict[str, float]:
    t0 = time.perf_counter()
    pieces = document_pieces(offsets, n_tokens=n_tokens, max_len=budget)
    rows = pack_rows(pieces[:, 1], row_len=budget)
    seconds = time.perf_counter() - t0
    real = int(pieces[:, 1].sum())
    docs = np.diff(np.concatenate([[0], offsets, [n_tokens - 1]]))
    return {"rows": len(rows), "padding": 1 - real / (len(rows) * budget),
            "docs_per_row": len(pieces) / len(rows), "cut_by_budget": float(np.mean(docs > budget)),
            "pack_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    directory = prepare(DataConfig())
    tokens = np.fromfile(directory / "train.bin", dtype=np.uint16)
    eod = 256
    corpora = {"stdlib files": np.flatnonzero(tokens == eod),
               "split at blank lines": short_documents(tokens, eod=eod)}
    lines = ["| corpus | documents | budget | rows | padding | docs/row | docs > budget | "
             "pack s |", "|---|---|---|---|---|---|---|---|"]
    for name, offsets in corpora.items():
        for budget in BUDGETS:
            s = row_stats(offsets, n_tokens=len(tokens), budget=budget)
            lines.append(f"| {name} | {len(offsets)} | {budget} | {s['rows']} | "
                         f"{s['padding']:.3%} | {s['docs_per_row']:.1f} | "
                         f"{s['cut_by_budget']:.1%} | {s['pack_s']:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(f"# Dynamic batching: padding per token budget\n\n"
                            f"`python benchmarks/bench_packing.py --out {args.out}` on "
                            f"{len(tokens):,} train tokens ({directory.name}).\n\n{text}\n")


if __name__ == "__main__":
    main()

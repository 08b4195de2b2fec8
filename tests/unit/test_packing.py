"""Dynamic batching (train.batching=tokens): the document index, whole-document rows, padding."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain.config.schema import DataConfig
from hpctrain.data.dataset import open_split
from hpctrain.data.packing import document_pieces, pack_rows
from hpctrain.data.prepare import BYTE_EOD, prepare
from hpctrain.ops.documents import IGNORE_INDEX

EOD = 9


def _files(tmp_path, texts, *, val_fraction=0.01):
    for i, t in enumerate(texts):
        (tmp_path / f"doc{i:03d}.txt").write_text(t)
    return DataConfig(source="files", paths=(str(tmp_path / "*.txt"),),
                      val_fraction=val_fraction, cache_dir=str(tmp_path / "cache"))


def test_pieces_cover_every_pair_once_inside_one_document():
    tokens = np.array([1, 2, EOD, 3, 4, 5, 6, 7, EOD, 8, EOD, 1, 2])
    offsets = np.flatnonzero(tokens == EOD)
    pieces = document_pieces(offsets, n_tokens=len(tokens), max_len=3)
    covered = [i for s, n in pieces.tolist() for i in range(s, s + n)]
    assert covered == list(range(len(tokens) - 1))  # pair i = (t_i, t_{i+1})
    assert pieces[:, 1].max() <= 3
    for s, n in pieces.tolist():  # an eod may open a piece (as its BOS), never sit inside it
        assert not np.any(tokens[s + 1:s + n] == EOD)


def test_best_fit_rows_hold_every_piece_once_within_the_budget():
    lengths = np.random.default_rng(0).lognormal(5, 1, size=2000).astype(int).clip(1, 1024)
    rows = pack_rows(lengths, row_len=1024)
    assert sorted(i for r in rows for i in r) == list(range(2000))
    assert all(sum(int(lengths[i]) for i in r) <= 1024 for r in rows)
    padding = 1 - lengths.sum() / (1024 * len(rows))
    assert padding < 0.01, padding  # many short documents of varied length fill rows closely
    assert pack_rows(lengths, row_len=1024) == rows  # a pure function of the lengths


def test_rows_are_whole_documents_with_ignored_padding(tmp_path):
    texts = ["abcdefg", "hi", "jklmnopqrstu", "vw", "x"]
    out = prepare(_files(tmp_path, texts, val_fraction=0.3))
    ds = open_split(out, "train", seq_len=8, packing="documents", batching="tokens")
    inputs, targets, docs = ds.rows(list(range(ds.n_samples)))
    real = targets != IGNORE_INDEX
    assert (inputs[~real] == BYTE_EOD).all()
    seen = []
    for b in range(len(inputs)):
        for k, n in enumerate(docs.lengths()[b]):
            sel = docs.ids_BL[b] == k
            if not real[b][sel].any():
                continue  # the padding document
            assert real[b][sel].all() and docs.positions_BL[b][sel].tolist() == list(range(n))
            x, y = inputs[b][sel].tolist(), targets[b][sel].tolist()
            assert x[1:] == y[:-1]  # targets are the inputs shifted, inside the document
            seen += y
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert sorted(seen) == sorted(train[1:].tolist())  # every token a target exactly once


def test_document_index_is_written_by_prepare_and_verified(tmp_path):
    out = prepare(_files(tmp_path, ["abc", "de", "fgh"], val_fraction=0.2))
    offsets = np.fromfile(out / "train.idx", dtype=np.int64)
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert offsets.tolist() == np.flatnonzero(tokens == BYTE_EOD).tolist()
    (out / "train.idx").unlink()  # an older cache without it: rebuilt on first use
    open_split(out, "train", seq_len=4, packing="documents", batching="tokens")
    assert np.fromfile(out / "train.idx", dtype=np.int64).tolist() == offsets.tolist()
    for bad in (offsets + 1, offsets[:-1]):  # shifted, truncated: refused, naming the fix
        bad.tofile(out / "train.idx")
        with pytest.raises(ValueError, match=r"train\.idx does not match .*delete"):
            open_split(out, "train", seq_len=4, packing="documents", batching="tokens")


def test_padding_below_5_percent_on_default_data_at_4096_tokens(tmp_path):
    """The default data (stdlib sources, byte-level, data.max_bytes default) at a 4,096-token
    micro-batch: measured, not assumed."""
    out = prepare(DataConfig(cache_dir=str(tmp_path)))
    ds = open_split(out, "train", seq_len=4096, packing="documents", batching="tokens")
    inputs, targets, _ = ds.rows(list(range(ds.n_samples)))
    measured = float((targets == IGNORE_INDEX).double().mean())
    assert measured == pytest.approx(ds.padding_fraction, abs=1e-12)
    assert measured < 0.05, measured


def test_packing_keys_have_defaults_and_clear_errors():
    from tests.conftest import make_config

    cfg = make_config([])
    assert (cfg.data.packing, cfg.train.batching) == ("documents", "rows")
    with pytest.raises(ValueError, match=r"data.packing='document' is not one of .*did you mean "
                                         r"data.packing=documents"):
        make_config(["data.packing=document"])
    with pytest.raises(ValueError, match=r"train.batching=tokens .* needs data.packing=documents"
                                         r", not data.packing=none: set data.packing=documents "
                                         r"or train.batching=rows"):
        make_config(["train.batching=tokens", "data.packing=none"])


def test_row_windows_carry_documents_split_at_the_end_token(tmp_path):
    out = prepare(_files(tmp_path, ["abc", "de", "fghij"], val_fraction=0.1))
    packed = open_split(out, "train", seq_len=8, packing="documents", batching="rows")
    inputs, targets, docs = packed.rows([0])
    assert inputs[0].tolist()[:5] == [97, 98, 99, BYTE_EOD, 100]
    assert docs.ids_BL[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2]  # the end token closes its own
    assert docs.positions_BL[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert (targets != IGNORE_INDEX).all()  # windows have no padding
    plain = open_split(out, "train", seq_len=8, packing="none", batching="rows")
    x, y, none = plain.rows([0])
    assert none is None and x.equal(inputs) and y.equal(targets)

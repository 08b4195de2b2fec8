"""Token preparation and the dp-sharded, resumable sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpctrain.config.schema import DataConfig
from hpctrain.data.dataset import Sampler, TokenDataset, batch
from hpctrain.data.prepare import BYTE_EOD, prepare


def _files(tmp_path, texts):
    for i, t in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(t)
    return DataConfig(source="files", paths=(str(tmp_path / "*.txt"),), val_fraction=0.25,
                      cache_dir=str(tmp_path / "cache"))


def test_byte_prepare_joins_documents_with_eod(tmp_path):
    out = prepare(_files(tmp_path, ["abc", "de"]))
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.concatenate([np.fromfile(out / "train.bin", dtype=meta["dtype"]),
                             np.fromfile(out / "val.bin", dtype=meta["dtype"])])
    assert tokens.tolist() == [97, 98, 99, BYTE_EOD, 100, 101, BYTE_EOD]
    assert meta["vocab_size"] == 257 and meta["eod"] == BYTE_EOD
    assert prepare(_files(tmp_path, ["abc", "de"])) == out  # cached: same inputs, same dir


def test_bpe_prepare_round_trips(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    cfg = _files(tmp_path, ["hello world, hello tokens " * 50, "another document here " * 30])
    cfg = DataConfig(**{**cfg.__dict__, "tokenizer": "bpe", "bpe_vocab_size": 300})
    out = prepare(cfg)
    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = np.fromfile(out / "train.bin", dtype=meta["dtype"]).tolist()
    first = ids[: ids.index(meta["eod"])]
    assert tok.decode(first) == "hello world, hello tokens " * 50
    assert max(ids) < 300


def test_stdlib_corpus_is_real_python(tmp_path):
    out = prepare(DataConfig(max_bytes=20000, cache_dir=str(tmp_path)))
    ds = TokenDataset(out, "train", seq_len=64)
    text = bytes(t for t in ds.tokens[:2000] if t < 256).decode()
    assert "def " in text or "import " in text


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sampler_shards_the_global_batch_exactly(dp):
    g, mb = 8, 2
    ref = Sampler(100, seed=1, global_batch=g, dp=1, micro_batch=mb)
    sharded = Sampler(100, seed=1, global_batch=g, dp=dp, micro_batch=mb)
    for step in range(30):  # crosses epoch boundaries (100 samples / 8 per step)
        full = [i for m in range(g // mb) for i in ref.indices(step, dp_rank=0, micro=m)]
        parts = [i for d in range(dp) for m in range(g // (mb * dp))
                 for i in sharded.indices(step, dp_rank=d, micro=m)]
        assert parts == full


def test_sampler_visits_every_sample_once_per_epoch():
    s = Sampler(24, seed=5, global_batch=8, dp=1, micro_batch=8)
    epoch = [i for step in range(3) for i in s.indices(step, dp_rank=0, micro=0)]
    assert sorted(epoch) == list(range(24))
    assert epoch != [i for step in range(3, 6) for i in s.indices(step, dp_rank=0, micro=0)]


def test_batch_targets_are_shifted_inputs(tmp_path):
    out = prepare(_files(tmp_path, ["0123456789" * 20]))
    ds = TokenDataset(out, "train", seq_len=8)
    x, y = batch(ds, [0, 3])
    assert x.shape == y.shape == (2, 8)
    assert (x[:, 1:] == y[:, :-1]).all()


def test_too_little_data_is_a_clear_error(tmp_path):
    out = prepare(_files(tmp_path, ["tiny"]))
    with pytest.raises(ValueError, match="fewer than train.seq_len"):
        TokenDataset(out, "train", seq_len=64)


def test_stdlib_sources_are_read_lazily_in_sorted_path_order():
    """The embedded corpus's file order (what its tokens and cache key depend on): the lazy walk
    gives exactly sorted(rglob("*.py")) without site-packages, and stops at data.max_bytes."""
    import sysconfig
    from pathlib import Path

    from hpctrain.data.prepare import _python_sources, source_files
    from tests.conftest import make_config

    root = Path(sysconfig.get_paths()["stdlib"])
    want = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    assert list(_python_sources(root)) == want
    data = make_config(["data.max_bytes=200000"]).data
    files = source_files(data)
    assert files == want[:len(files)]
    assert sum(f.stat().st_size for f in files[:-1]) < 200000 <= sum(f.stat().st_size
                                                                     for f in files)

"""A prepared token directory is checked before any rank reads it: sizes always, content on
first use, ids against the vocabulary; damage is refused naming the file and the rebuild."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hpctrain import dispatch
from hpctrain.config.schema import DataConfig
from hpctrain.data.prepare import prepare
from hpctrain.data.verify import MARKER, check_token_dir
from tests.conftest import make_config

REBUILD = "delete it"


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 800)
    data = DataConfig(source="files", paths=(str(tmp_path / "a.txt"),),
                      cache_dir=str(tmp_path / "cache"))
    return prepare(data)


def test_a_good_cache_is_hashed_once_then_only_stated(prepared):
    assert not (prepared / MARKER).exists()
    assert check_token_dir(prepared, vocab_size=512, rebuild=REBUILD) == []
    marker = json.loads((prepared / MARKER).read_text())
    assert set(marker["signature"]) >= {"train.bin", "val.bin", "train.idx", "val.idx"}
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert marker["max_id"]["train.bin"] == manifest["files"]["train.bin"]["max_id"]


def test_a_truncated_token_file_is_refused(prepared):
    size = (prepared / "train.bin").stat().st_size
    with open(prepared / "train.bin", "r+b") as f:
        f.truncate(2000)
    (err,) = check_token_dir(prepared, vocab_size=512, rebuild=REBUILD)
    tokens = json.loads((prepared / "meta.json").read_text())["train_tokens"]
    assert f"train.bin holds 2,000 bytes, but meta.json counts {tokens:,} tokens" in err
    assert f"({size:,} bytes)" in err and err.endswith(REBUILD)


def test_changed_content_of_the_same_size_is_refused_even_after_a_good_first_use(prepared):
    assert check_token_dir(prepared, vocab_size=512, rebuild=REBUILD) == []
    with open(prepared / "val.idx", "r+b") as f:  # one byte of the document index
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    os.utime(prepared / "val.idx", ns=(1, 1))  # a new modification time, as any write gives
    (err,) = check_token_dir(prepared, vocab_size=512, rebuild=REBUILD)
    assert "val.idx's content differs from its manifest (sha256)" in err


def test_an_edit_with_its_size_and_mtime_put_back_is_verified_again(prepared):
    """Issue 45: an edited cache whose size and modification time were restored was trusted
    (the marker compared only those)."""
    assert check_token_dir(prepared, vocab_size=512, rebuild=REBUILD) == []
    path = prepared / "train.bin"
    st = path.stat()
    with open(path, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime, as `touch -r` would
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    (err,) = check_token_dir(prepared, vocab_size=512, rebuild=REBUILD)
    assert "train.bin's content differs from its manifest (sha256)" in err


def test_ids_outside_the_vocabulary_are_refused_with_and_without_a_manifest(prepared):
    files = json.loads((prepared / "manifest.json").read_text())["files"]
    top = max(files["train.bin"]["max_id"], files["val.bin"]["max_id"])
    (err,) = check_token_dir(prepared, vocab_size=100, rebuild=REBUILD)
    assert f"holds token id {top}, but" in err
    assert "model.vocab_size=100 (ids 0..99): set model.vocab_size=" in err
    (prepared / "manifest.json").unlink()  # a hand-made directory: the ids are measured
    (prepared / MARKER).unlink(missing_ok=True)
    tokens = np.fromfile(prepared / "train.bin", dtype="<u2")
    tokens[5] = 3000
    tokens.tofile(prepared / "train.bin")
    (err,) = check_token_dir(prepared, vocab_size=512, rebuild=REBUILD)
    assert "train.bin holds token id 3000" in err and "set model.vocab_size=4096" in err


def test_preflight_refuses_a_damaged_cache_before_any_rank(tmp_path):
    cfg = make_config(["model=debug", "train=debug", "data.max_bytes=200000",
                       f"data.cache_dir={tmp_path / 'cache'}"], run_dir=tmp_path / "run")
    dispatch.preflight(cfg)  # prepares and verifies
    data_dir = prepare(cfg.data)
    with open(data_dir / "train.bin", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ValueError) as refused:
        dispatch.preflight(cfg)
    text = str(refused.value)
    assert "train.bin holds 1,000 bytes" in text and f"delete {data_dir} and run again" in text

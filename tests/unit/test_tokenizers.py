"""data.tokenizer = hf | tiktoken (issue 24): each document encoded without special tokens,
framed by hpctrain with bos/eod; both and the tokenizer's hash in meta.json; uint32 tokens
above a 65,536 vocabulary, read back by the trainer's dataset."""

from __future__ import annotations

import hashlib
import json
import re
import sys

import numpy as np
import pytest

from hpctrain.data.dataset import TokenDataset
from hpctrain.data.prepare import prepare
from tests.unit.test_corpus import all_tokens, data_config, jsonl_lines
from tests.unit.tokenizer_files import hf_tokenizer_dir, tiktoken_file

DOCS = ["hello world , w3 w7", "w1 hello", "unknownword w2"]


def _jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(jsonl_lines(*({"text": d} for d in DOCS)))
    return path


def test_hf_ids_are_encode_without_special_tokens_framed_by_bos_eod(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    root = hf_tokenizer_dir(tmp_path / "tok")
    out = prepare(data_config(tmp_path, [_jsonl(tmp_path)], format="jsonl", tokenizer="hf",
                              tokenizer_path=str(root)))
    tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    bos, eod = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    want = [t for d in DOCS for t in [bos, *tok.encode(d, add_special_tokens=False).ids, eod]]
    tokens, meta = all_tokens(out)
    assert tokens == want and tok.encode(DOCS[0]).ids[0] == bos  # the template is not used
    assert (meta["bos"], meta["eod"], meta["bos_token"], meta["eod_token"]) == (
        bos, eod, "<s>", "</s>")
    assert meta["tokenizer_sha256"] == hashlib.sha256(
        (root / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size()


def test_hf_special_tokens_from_config_or_overrides(tmp_path):
    pytest.importorskip("tokenizers")
    root = hf_tokenizer_dir(tmp_path / "tok", config={"bos_token": {"content": "<pad>"},
                                                      "eos_token": "<pad>"})
    cfg = dict(format="jsonl", tokenizer="hf", tokenizer_path=str(root / "tokenizer.json"))
    meta = all_tokens(prepare(data_config(tmp_path, [_jsonl(tmp_path)], **cfg)))[1]
    assert (meta["bos_token"], meta["eod_token"]) == ("<pad>", "<pad>")
    tokens, meta = all_tokens(prepare(data_config(tmp_path, [_jsonl(tmp_path)], **cfg,
                                                  bos_token="", eod_token="</s>")))
    assert meta["bos"] is None and tokens[:6] == [4, 5, 6, 10, 14, 2]  # hello world , w3 w7 </s>


def test_tiktoken_encode_ordinary_uint32_read_by_the_dataset(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    path = tiktoken_file(tmp_path / "cl100k_base.tiktoken")
    out = prepare(data_config(tmp_path, [_jsonl(tmp_path)], format="jsonl", tokenizer="tiktoken",
                              tokenizer_path=str(path), eod_token="<|endoftext|>"))
    tokens, meta = all_tokens(out)
    from hpctrain.data.tokenizer import TokenizerSpec, load

    enc = load(TokenizerSpec("tiktoken", str(path), eod_token="<|endoftext|>")).impl
    assert isinstance(enc, tiktoken.Encoding)
    want = [t for d in DOCS for t in [*enc.encode_ordinary(d), 100257]]
    assert tokens == want and meta["eod"] == 100257 and meta["bos"] is None
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == enc.n_vocab > 65536
    ds = TokenDataset(out, "train", seq_len=8)
    assert ds.sample(0).tolist() == want[:9] and ds.tokens.dtype == np.uint32
    assert json.loads((out / "manifest.json").read_text())["files"]["train.bin"]["max_id"] == 100257


@pytest.mark.parametrize("kw,words", [
    (dict(tokenizer="tiktoken"), ["names no end-of-document token", "data.eod_token=",
                                  "<|endoftext|>"]),
    (dict(tokenizer="tiktoken", eod_token="<|eot|>"), ["data.eod_token='<|eot|>' is not a "
                                                       "token", "<|endoftext|>"]),
    (dict(tokenizer="hf", bos_token="<bos>"), ["data.bos_token='<bos>'", "<s>"]),
    (dict(tokenizer="hf", tokenizer_path="/nonexistent"), ["data.tokenizer_path=/nonexistent",
                                                           "no such file"]),
    (dict(tokenizer="tiktoken", tokenizer_path="mine.tiktoken", eod_token="x"),
     ["its name must say which encoding", "cl100k_base.tiktoken"]),
    (dict(tokenizer="byte", eod_token="</s>"), ["data.eod_token='</s>'", "remove"]),
])
def test_tokenizer_mistakes_name_the_key_and_fix(tmp_path, kw, words):
    pytest.importorskip("tiktoken")
    pytest.importorskip("tokenizers")
    from hpctrain.data.prepare import tokenizer_vocab

    hf_tokenizer_dir(tmp_path)
    tiktoken_file(tmp_path / "cl100k_base.tiktoken")
    (tmp_path / "mine.tiktoken").write_text("")
    path = {"hf": str(tmp_path), "tiktoken": str(tmp_path / "cl100k_base.tiktoken")}
    kw.setdefault("tokenizer_path", path.get(kw["tokenizer"]))
    if kw["tokenizer_path"] == "mine.tiktoken":
        kw["tokenizer_path"] = str(tmp_path / "mine.tiktoken")
    with pytest.raises(ValueError) as info:
        tokenizer_vocab(data_config(tmp_path, [], **kw))
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_missing_extra_is_named_before_launch(tmp_path, monkeypatch):
    """Without the data/hf extras the default run still works, and each key that needs one is
    refused naming the pip command."""
    from tests.conftest import make_config

    for module in ("tokenizers", "tiktoken", "tiktoken_ext", "pyarrow", "zstandard", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    (tmp_path / "a.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")  # told by content, not name
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    tiktoken_file(tmp_path / "cl100k_base.tiktoken")
    make_config(["train=debug"], run_dir=tmp_path)
    cases = [(["data=files", "data.format=jsonl", f"data.paths=[{tmp_path}/a.jsonl.zst]"],
              "data.format=jsonl needs zstandard: pip install 'hpctrain[data]'"),
             (["data=files", "data.format=jsonl",
               f"data.mixture=[{{paths:[{tmp_path}/a.jsonl.zst],weight:1}}]"],
              "data.format=jsonl needs zstandard"),
             (["data=files", "data.format=parquet", f"data.paths=[{tmp_path}/p.parquet]"],
              "data.format=parquet needs pyarrow: pip install 'hpctrain[data]'"),
             (["data=files", "data.format=hf", f"data.paths=[{tmp_path}/ds]"],
              "data.format=hf needs datasets: pip install 'hpctrain[hf]'"),
             (["data.tokenizer=tiktoken", f"data.tokenizer_path={tmp_path}/cl100k_base.tiktoken"],
              "data.tokenizer=tiktoken needs the tiktoken package: pip install 'hpctrain[data]'"),
             (["data.tokenizer=bpe"], "data.tokenizer=bpe needs the tokenizers package")]
    for overrides, text in cases:
        with pytest.raises(ValueError, match=re.escape(text)):
            make_config(overrides, run_dir=tmp_path)

"""Real corpora in (issue 24): data.format = jsonl | parquet | hf | text, shards of files and
directories, empty records skipped and counted, bad records refused (file, line/row, fix) or
skipped with data.on_bad_record=skip. Byte-level tokens, so the expected ids are the bytes."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from hpctrain.config.schema import Corpus, DataConfig
from hpctrain.data.prepare import BYTE_EOD, prepare


def data_config(tmp_path, paths, **kw) -> DataConfig:
    return DataConfig(source="files", paths=tuple(str(p) for p in paths), val_fraction=0.1,
                      cache_dir=str(tmp_path / "cache"), **kw)


def all_tokens(out):
    meta = json.loads((out / "meta.json").read_text())
    parts = [np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")]
    return np.concatenate(parts).tolist(), meta


def framed(*docs: str) -> list[int]:
    return [t for d in docs for t in [*d.encode(), BYTE_EOD]]


def jsonl_lines(*objs) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def test_jsonl_plain_gz_zst_directory_in_order_empty_skipped(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.jsonl").write_bytes(b"\xef\xbb\xbf" +  # a byte-order mark
                                     jsonl_lines({"text": "alpha", "id": 1}, {"text": ""}))
    (shards / "b.jsonl.gz").write_bytes(gzip.compress(b"\n" + jsonl_lines({"text": "béta"})))
    (shards / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        jsonl_lines({"text": "gamma"}, {"text": "delta"})))
    (shards / "README.md").write_text("not a shard")
    (shards / "state.json").write_text('{"not": "a shard"}')
    out = prepare(data_config(tmp_path, [shards], format="jsonl"))
    tokens, meta = all_tokens(out)
    assert tokens == framed("alpha", "béta", "gamma", "delta")
    assert (meta["documents"], meta["skipped_empty"], meta["skipped_bad"]) == (4, 1, 0)
    assert meta["train_documents"] + meta["val_documents"] == 4


def test_compression_is_read_from_the_content_not_the_name(tmp_path):
    """A gzip stream named .jsonl and plain JSON Lines named .gz (issue 45: names lie)."""
    (tmp_path / "a.jsonl").write_bytes(gzip.compress(jsonl_lines({"text": "zipped"})))
    (tmp_path / "b.jsonl.gz").write_bytes(jsonl_lines({"text": "plain"}))
    out = prepare(data_config(tmp_path, [tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"],
                              format="jsonl"))
    assert all_tokens(out)[0] == framed("zipped", "plain")


def test_a_tokenizer_path_alone_tokenises_with_that_tokenizer(tmp_path):
    """data.tokenizer unset with data.tokenizer_path: its kind, never bytes (issue 45: data=files
    with a tokenizer directory prepared byte tokens)."""
    from tests.unit.tokenizer_files import hf_tokenizer_dir

    tokenizers = pytest.importorskip("tokenizers")
    tok = hf_tokenizer_dir(tmp_path / "tok")
    (tmp_path / "a.jsonl").write_bytes(jsonl_lines({"text": "hello world"}))
    data = data_config(tmp_path, [tmp_path / "a.jsonl"], format="jsonl",
                       tokenizer_path=str(tok))
    assert data.tokenizer == "hf"
    ids = tokenizers.Tokenizer.from_file(str(tok / "tokenizer.json")).encode(
        "hello world", add_special_tokens=False).ids
    tokens = all_tokens(prepare(data))[0]
    assert tokens[:len(ids)] == ids or tokens[1:len(ids) + 1] == ids  # after a bos, if any
    assert DataConfig(tokenizer_path="x/cl100k_base.tiktoken").tokenizer == "tiktoken"
    assert DataConfig().tokenizer == "byte"


def test_text_key_and_globs(tmp_path):
    (tmp_path / "x1.jsonl").write_bytes(jsonl_lines({"body": "one"}))
    (tmp_path / "x2.jsonl").write_bytes(jsonl_lines({"body": "two"}))
    out = prepare(data_config(tmp_path, [tmp_path / "x*.jsonl"], format="jsonl",
                              text_key="body"))
    assert all_tokens(out)[0] == framed("one", "two")


def test_parquet_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": [1, 2, 3], "content": ["first doc", "", "third"]})
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=2)
    out = prepare(data_config(tmp_path, [tmp_path], format="parquet", text_key="content"))
    tokens, meta = all_tokens(out)
    assert tokens == framed("first doc", "third") and meta["skipped_empty"] == 1


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["hello", "world"]}).save_to_disk(tmp_path / "ds")
    out = prepare(data_config(tmp_path, [tmp_path / "ds"], format="hf"))
    assert all_tokens(out)[0] == framed("hello", "world")
    datasets.Dataset.from_dict({"text": ["saved again"]}).save_to_disk(tmp_path / "ds2")
    for name in ("data-00000-of-00001.arrow", "state.json", "dataset_info.json"):
        (tmp_path / "ds2" / name).replace(tmp_path / "ds" / name)  # new contents, same dir
    assert all_tokens(prepare(data_config(tmp_path, [tmp_path / "ds"], format="hf")))[0] == \
        framed("saved again")


def _corrupt_gzip(path):
    data = gzip.compress(jsonl_lines(*({"text": f"doc {i}"} for i in range(200))))
    path.write_bytes(data[: len(data) // 2])


def _corrupt_parquet(path):
    path.write_bytes(b"PAR1 this is not parquet PAR1")


BAD = [  # file name, how to write it, words the message must hold
    ("a.jsonl", lambda p: p.write_bytes(jsonl_lines({"text": "ok"}, {"txt": "x"})),
     ["line 2", "no key 'text'", "keys: txt", "data.text_key"]),
    ("a.jsonl", lambda p: p.write_bytes(jsonl_lines({"text": 5})),
     ["line 1", "'text' is int, not a string"]),
    ("a.jsonl", lambda p: p.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n'),
     ["line 2", "not UTF-8"]),
    ("a.jsonl", lambda p: p.write_bytes(b'{"text": "ok"}\n{"text": \n'),
     ["line 2", "not valid JSON"]),
    ("a.jsonl", lambda p: p.write_bytes(b'["text"]\n'), ["line 1", "a JSON list"]),
    ("a.jsonl.gz", _corrupt_gzip, ["unreadable compressed stream"]),
    ("a.parquet", _corrupt_parquet, ["row 0", "unreadable Parquet"]),
]


@pytest.mark.parametrize("name,write,words", BAD, ids=[f"{n} {w[-1]}" for n, _, w in BAD])
def test_bad_record_is_one_clear_error_or_skipped(tmp_path, name, write, words):
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    fmt = "parquet" if name.endswith(".parquet") else "jsonl"
    write(tmp_path / name)
    with pytest.raises(ValueError) as info:
        prepare(data_config(tmp_path, [tmp_path / name], format=fmt))
    message = str(info.value)
    for word in [str(tmp_path / name), *words, "data.on_bad_record=skip"]:
        assert word in message, message
    out = prepare(data_config(tmp_path, [tmp_path / name], format=fmt, on_bad_record="skip"))
    assert json.loads((out / "meta.json").read_text())["skipped_bad"] == 1


def test_text_files_are_whole_documents_and_uncapped(tmp_path):
    """data.max_bytes caps the stdlib default only: a files corpus is read whole."""
    (tmp_path / "a.txt").write_text("x" * 50)
    (tmp_path / "b.txt").write_text("")
    out = prepare(data_config(tmp_path, [tmp_path / "*.txt"], max_bytes=10))
    tokens, meta = all_tokens(out)
    assert tokens == framed("x" * 50) and meta["skipped_empty"] == 1


def test_val_paths_are_the_val_split(tmp_path):
    """data.val_paths: the val split is exactly those files' documents (no val_fraction cut)."""
    (tmp_path / "train.jsonl").write_bytes(jsonl_lines({"text": "t1"}, {"text": "t2"}))
    (tmp_path / "val.jsonl").write_bytes(jsonl_lines({"text": "v1"}, {"text": ""}))
    out = prepare(data_config(tmp_path, [tmp_path / "train.jsonl"], format="jsonl",
                              val_paths=(str(tmp_path / "val.jsonl"),)))
    meta = json.loads((out / "meta.json").read_text())
    split = {s: np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]).tolist()
             for s in ("train", "val")}
    assert split == {"train": framed("t1", "t2"), "val": framed("v1")}
    assert (meta["train_documents"], meta["val_documents"], meta["val_from"]) == (
        2, 1, "val_paths")
    assert np.fromfile(out / "val.idx", dtype=np.int64).tolist() == [2]
    (tmp_path / "val.jsonl").write_bytes(jsonl_lines({"text": "v2 changed"}))
    again = prepare(data_config(tmp_path, [tmp_path / "train.jsonl"], format="jsonl",
                                val_paths=(str(tmp_path / "val.jsonl"),)))
    assert again != out and all_tokens(again)[0] == framed("t1", "t2", "v2 changed")


def test_mixture_writes_each_corpus_once_with_its_ranges_and_the_weights_reuse_it(tmp_path):
    """a: 10 documents of 5 tokens, b: 10 of 10; val_fraction 0.1 keeps each corpus's last
    document back. The train split is a's train part then b's, once each; meta.json records
    their ranges. The weights are drawn at run time: other weights give the same directory."""
    (tmp_path / "a.jsonl").write_bytes(jsonl_lines(*[{"text": "aaaa"}] * 10))
    (tmp_path / "b.jsonl").write_bytes(jsonl_lines(*[{"text": "b" * 9}] * 10))
    mixture = (Corpus(paths=(str(tmp_path / "a.jsonl"),), weight=2.0, name="a"),
               Corpus(paths=(str(tmp_path / "b.jsonl"),), weight=1.0))
    out = prepare(data_config(tmp_path, [], format="jsonl", mixture=mixture))
    meta = json.loads((out / "meta.json").read_text())
    split = {s: np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]).tolist()
             for s in ("train", "val")}
    assert split["train"] == framed(*["aaaa"] * 9, *["b" * 9] * 9)
    assert split["val"] == framed("aaaa", "b" * 9)
    assert [(m["name"], m["tokens"], m["train"], m["val"]) for m in meta["mixture"]] == [
        ("a", 50, [0, 45], [0, 5]), ("corpus1", 100, [45, 135], [5, 15])]
    assert (meta["train_documents"], meta["val_documents"]) == (18, 2)
    idx = np.fromfile(out / "train.idx", dtype=np.int64)
    assert idx.tolist() == np.flatnonzero(np.array(split["train"]) == BYTE_EOD).tolist()
    even = (Corpus(paths=mixture[0].paths, weight=1.0, name="a"), mixture[1])
    assert prepare(data_config(tmp_path, [], format="jsonl", mixture=even)) == out
    renamed = (mixture[0], Corpus(paths=mixture[1].paths, weight=1.0, name="b"))
    assert prepare(data_config(tmp_path, [], format="jsonl", mixture=renamed)) != out


def test_each_corpus_is_read_in_its_own_format_and_text_key(tmp_path):
    """data.format=jsonl; corpus a overrides the text key, corpus b is text files; a bpe
    tokenizer trains on both (their documents, not their JSON)."""
    (tmp_path / "a.jsonl").write_bytes(jsonl_lines(*[{"content": f"alpha{i}"}
                                                     for i in range(10)]))
    (tmp_path / "b").mkdir()
    for i in range(10):
        (tmp_path / "b" / f"{i}.txt").write_text(f"beta{i}")
    mixture = (Corpus(paths=(str(tmp_path / "a.jsonl"),), weight=1.0, name="a",
                      text_key="content"),
               Corpus(paths=(str(tmp_path / "b"),), weight=1.0, name="b", format="text"))
    out = prepare(data_config(tmp_path, [], format="jsonl", mixture=mixture))
    tokens, _ = all_tokens(out)
    docs = [f"alpha{i}" for i in range(9)] + [f"beta{i}" for i in range(9)] + ["alpha9", "beta9"]
    assert tokens == framed(*docs)
    bpe = prepare(data_config(tmp_path, [], format="jsonl", mixture=mixture, tokenizer="bpe",
                              bpe_vocab_size=300))
    vocab = json.loads((bpe / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"alpha", "beta"} <= vocab.keys()  # merged from both corpora's documents
    assert not any("{" in k or "content" in k for k in vocab if len(k) > 1)  # never the JSON

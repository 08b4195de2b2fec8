"""task=prepare (issue 24): sharded over worker processes with byte-identical output,
resumable after an interruption, a manifest that verifies every file, progress and summary."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from hpctrain.data import prepare as prep
from tests.conftest import make_config
from tests.unit.test_corpus import data_config, jsonl_lines


def _corpus(tmp_path, n=4):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(n):
        docs = [{"text": f"file {i} doc {j} " * (j + 1)} for j in range(3)] + [{"text": ""}]
        # compressed: a whole file is one unit at data.shard_bytes=1 (plain ones are cut)
        (root / f"part-{i}.jsonl.gz").write_bytes(gzip.compress(jsonl_lines(*docs), mtime=0))
    return root


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_output_is_byte_identical_whatever_the_workers(tmp_path):
    corpus = _corpus(tmp_path)
    one = prep.prepare(data_config(tmp_path / "a", [corpus], format="jsonl", shard_bytes=1))
    two = prep.prepare(data_config(tmp_path / "b", [corpus], format="jsonl", shard_bytes=1,
                                   workers=2))
    assert _files(one) == _files(two)
    assert json.loads((one / "manifest.json").read_text())["shards"] == 4


def test_manifest_records_size_tokens_max_id_and_sha256(tmp_path):
    out = prep.prepare(data_config(tmp_path, [_corpus(tmp_path)], format="jsonl"))
    manifest = json.loads((out / "manifest.json").read_text())["files"]
    meta = json.loads((out / "meta.json").read_text())
    for split in ("train", "val"):
        raw = (out / f"{split}.bin").read_bytes()
        tokens = np.frombuffer(raw, dtype=meta["dtype"])
        entry = manifest[f"{split}.bin"]
        assert entry == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                         "tokens": len(tokens), "max_id": int(tokens.max())}
        assert entry["tokens"] == meta[f"{split}_tokens"]
        idx = (out / f"{split}.idx").read_bytes()
        assert manifest[f"{split}.idx"]["sha256"] == hashlib.sha256(idx).hexdigest()
        assert manifest[f"{split}.idx"]["documents"] == meta[f"{split}_documents"]
    assert (meta["documents"], meta["skipped_empty"]) == (12, 4)


def test_interrupted_prepare_resumes_keeping_finished_shards(tmp_path, monkeypatch):
    corpus = _corpus(tmp_path)
    cfg = data_config(tmp_path, [corpus], format="jsonl", shard_bytes=1)
    written, real = [], prep.write_shard

    def interrupted(unit):
        if unit.index == 2 and not written.count("stop"):
            written.append("stop")
            raise KeyboardInterrupt
        written.append(unit.index)
        return real(unit)

    monkeypatch.setattr(prep, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(cfg)
    out = prep.prepare(cfg)
    assert written == [0, 1, "stop", 2, 3]  # shards 0 and 1 were kept, not written again
    fresh = prep.prepare(data_config(tmp_path / "fresh", [corpus], format="jsonl",
                                     shard_bytes=1))
    assert _files(out) == _files(fresh)


def test_progress_lines_and_summary(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(prep, "PROGRESS_S", 0.0)
    caplog.set_level(logging.INFO, logger="hpctrain.data.prepare")
    prep.prepare(data_config(tmp_path, [_corpus(tmp_path, n=2)], format="jsonl",
                             shard_bytes=1))
    text = caplog.text
    assert "docs/s" in text and "tokens/s" in text and "ETA" in text
    assert "prepared 6 documents" in text and "(skipped 2 empty, 0 bad)" in text


def test_task_prepare_runs_alone(tmp_path):
    from hpctrain import dispatch

    corpus = _corpus(tmp_path, n=1)
    cfg = make_config(["task=prepare", "data=files", f"data.paths=[{corpus}]",
                       "data.format=jsonl", f"data.cache_dir={tmp_path / 'cache'}"],
                      run_dir=tmp_path)
    result = dispatch.run(cfg)
    assert result["documents"] == 3 and result["train_tokens"] > 0
    assert (tmp_path / "cache" / "data").is_dir() and "data_dir" in result


def test_one_big_jsonl_file_is_cut_into_byte_ranges(tmp_path):
    """A plain JSON Lines file larger than data.shard_bytes becomes several units (lines that
    begin in each range): the same bytes as one unit, whatever the workers; a bad record in a
    later range is named by its line number in the file."""
    lines = [{"text": f"document {i} " + "x" * (i % 7)} for i in range(40)] + [{"text": ""}]
    (tmp_path / "big.jsonl").write_bytes(jsonl_lines(*lines))
    whole = prep.prepare(data_config(tmp_path / "a", [tmp_path / "big.jsonl"], format="jsonl"))
    cut = prep.prepare(data_config(tmp_path / "b", [tmp_path / "big.jsonl"], format="jsonl",
                                   shard_bytes=97, workers=2))
    assert _files(whole) | {"manifest.json": b""} == _files(cut) | {"manifest.json": b""}
    assert json.loads((cut / "manifest.json").read_text())["shards"] > 10
    assert json.loads((cut / "meta.json").read_text())["skipped_empty"] == 1
    (tmp_path / "big.jsonl").write_bytes(jsonl_lines(*lines[:33], {"txt": 1}, *lines[33:]))
    with pytest.raises(ValueError, match="line 34"):
        prep.prepare(data_config(tmp_path / "c", [tmp_path / "big.jsonl"], format="jsonl",
                                 shard_bytes=97))


def _share(directory: str, corpus: str, task: int, tasks: int, timeout_s: float) -> str:
    """One task of a shared prepare, in its own process (as a Slurm task)."""
    from tests.unit.test_corpus import data_config as config

    data = config(Path(directory), [corpus], format="jsonl", shard_bytes=1, tokenizer="bpe",
                  bpe_vocab_size=300)
    return str(prep.prepare(data, share=(task, tasks), timeout_s=timeout_s))


def test_tasks_sharing_a_prepare_give_the_bytes_of_one(tmp_path):
    """Three processes, as the tasks of a Slurm job: each tokenises its share of the units,
    task 0 trains the bpe tokenizer first and assembles: the same bytes as one process."""
    corpus = _corpus(tmp_path)
    alone = prep.prepare(data_config(tmp_path / "a", [corpus], format="jsonl", shard_bytes=1,
                                     tokenizer="bpe", bpe_vocab_size=300))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        outs = pool.starmap(_share, [(str(tmp_path / "b"), str(corpus), t, 3, 60)
                                     for t in (2, 1, 0)])
    assert len(set(outs)) == 1
    assert _files(alone) == _files(Path(outs[0]))


def test_a_shared_prepare_whose_task_died_stops_with_the_fix(tmp_path):
    corpus = _corpus(tmp_path)
    data = data_config(tmp_path, [corpus], format="jsonl", shard_bytes=1)
    with pytest.raises(ValueError, match=r"without progress for the shards of tasks 1..1 .*"
                                         r"run task=prepare again"):
        prep.prepare(data, share=(0, 2), timeout_s=1)  # task 1 never came
    assert prep.prepare(data).is_dir()  # run again, alone: the finished shards are kept

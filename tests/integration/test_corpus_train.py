"""Real corpora end to end (issue 24): the README's example — train on a local JSON Lines
corpus with a pretrained tokenizer — and a bad record refused by the entry point before any
rank starts (exit 2, one message naming the file and line, no traceback)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

from hpctrain.metrics.logger import read_jsonl
from tests.conftest import ROOT
from tests.unit.tokenizer_files import hf_tokenizer_dir, tiktoken_file

SMALL = ["model=debug", "train=debug", "train.steps=4", "logger.wandb=disabled",
         "logger.progress=plain", "data.val_fraction=0.2"]


def _corpus(path, n_docs=60):
    rng = random.Random(0)
    docs = [" ".join(f"w{rng.randrange(40)}" for _ in range(rng.randrange(5, 60)))
            for _ in range(n_docs)]
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _run(overrides, tmp_path):
    cmd = [sys.executable, "-m", "hpctrain", *SMALL, "data=jsonl",  # the README's preset
           f"data.tokenizer_path={hf_tokenizer_dir(tmp_path / 'tok')}",
           f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}",
           *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, proc.stdout + proc.stderr


def test_train_on_jsonl_with_a_pretrained_tokenizer(tmp_path):
    proc, out = _run([f"data.paths=[{_corpus(tmp_path / 'c.jsonl')}]"], tmp_path)
    assert proc.returncode == 0, out[-3000:]
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    meta = json.loads(next((tmp_path / "cache" / "data").glob("*/meta.json")).read_text())
    assert (meta["tokenizer"], meta["bos_token"], meta["eod_token"]) == ("hf", "<s>", "</s>")


def test_train_reads_uint32_tokens_of_a_tiktoken_vocabulary(tmp_path):
    """cl100k's end-of-text id 100257 needs uint32 token files; the trainer reads them."""
    rank_file = tiktoken_file(tmp_path / "cl100k_base.tiktoken")
    proc, out = _run([f"data.paths=[{_corpus(tmp_path / 'c.jsonl')}]", "data.tokenizer=tiktoken",
                      f"data.tokenizer_path={rank_file}", "data.eod_token='<|endoftext|>'",
                      "model.vocab_size=100352"], tmp_path)
    assert proc.returncode == 0, out[-3000:]
    meta = json.loads(next((tmp_path / "cache" / "data").glob("*/meta.json")).read_text())
    assert (meta["dtype"], meta["eod"], meta["vocab_size"]) == ("uint32", 100257, 100277)
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)


def test_bad_record_refused_before_any_rank(tmp_path):
    corpus = _corpus(tmp_path / "c.jsonl")
    with open(corpus, "a") as f:
        f.write('{"txt": "a typo in the key"}\n')
    proc, out = _run([f"data.paths=[{corpus}]"], tmp_path)
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "Error executing job" not in out, out
    assert f"bad record in {corpus} (line 61): no key 'text'" in out
    assert "data.on_bad_record=skip" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

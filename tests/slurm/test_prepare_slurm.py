"""task=prepare on the local Slurm cluster: the job's tasks share the units (none is left to
the submitting process) and the result is byte-identical to one local process."""

from __future__ import annotations

import gzip

import pytest

from hpctrain.data import prepare as prep
from tests.slurm.test_train_slurm import _hpctrain
from tests.unit.test_corpus import data_config, jsonl_lines

pytestmark = pytest.mark.slurm


def test_prepare_shares_its_units_over_the_jobs_tasks(slurm_cluster, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):  # compressed: one unit per file at data.shard_bytes=1
        docs = [{"text": f"file {i} doc {j} " * (j + 1)} for j in range(5)]
        (corpus / f"part-{i}.jsonl.gz").write_bytes(gzip.compress(jsonl_lines(*docs), mtime=0))
    proc = _hpctrain(["cluster=slurm_local", "task=prepare", "cluster.procs_per_node=2",
                      "data=files", "data.format=jsonl", f"data.paths=[{corpus}]",
                      "data.shard_bytes=1", "data.val_fraction=0.1",
                      f"data.cache_dir={tmp_path / 'slurm'}", f"hydra.sweep.dir={tmp_path / 'sw'}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    logs = "".join(p.read_text() for p in (tmp_path / "sw").rglob("*_log.err"))
    assert logs.count("prepared 30 documents") == 1  # task 0 assembled, once
    for task in (0, 1):
        assert f"prepare: task {task} of 2 tokenises 3 of the 6 units" in logs
    alone = prep.prepare(data_config(tmp_path / "local", [corpus], format="jsonl",
                                     shard_bytes=1))
    (shared,) = [p for p in (tmp_path / "slurm" / "data").iterdir() if p.suffix != ".lock"]
    assert shared.name == alone.name
    assert {p.name: p.read_bytes() for p in shared.iterdir()} == {
        p.name: p.read_bytes() for p in alone.iterdir()}

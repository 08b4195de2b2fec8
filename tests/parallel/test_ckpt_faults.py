"""Checkpoint faults on resume (issue 11): every damage to the newest checkpoint makes the run
fall back to the previous verified one, named in one log line, and the resumed trajectory is
bit-identical to an uninterrupted run (CPU fp32); a damaged explicit checkpoint, another model
shape and crafted pickles stop with one clear message and run no code; with dp=2 every rank
takes the same fallback even when only rank 1's file is damaged.

One split run (checkpoints at steps 2 and 4) is trained once; each case damages a copy of it.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch

from hpctrain import dispatch
from hpctrain.checkpoint import manifest
from hpctrain.metrics.logger import read_jsonl
from tests.conftest import make_config
from tests.parallel.trainer_runs import run_trainer

OVER = ["model=debug", "train=debug", "data.max_bytes=200000", "logger.wandb=disabled",
        "logger.progress=plain", "train.eval_every=0", "train.steps=6",
        "train.checkpoint_every=2"]
NEWEST = "checkpoints/step_00000004"


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """An uninterrupted run and one stopped after step 4 (checkpoints at 2 and 4)."""
    root = tmp_path_factory.mktemp("ckpt_faults")
    dispatch.run(make_config(OVER, run_dir=root / "full"))
    dispatch.run(make_config([*OVER, "train.stop_after=4"], run_dir=root / "split"))
    return {"full": root / "full", "split": root / "split"}


def _copy(runs, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(runs["split"], run_dir)
    return run_dir


class _Lines(logging.Handler):
    """Records of one logger (the rank's logging setup replaces the root's handlers)."""

    def __init__(self, name: str):
        super().__init__()
        self.lines: list[str] = []
        self.logger = logging.getLogger(name)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def _overwrite(path: Path, *, at: float, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    start = int(len(raw) * at)
    raw[start:start + len(data)] = data
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shards(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.distcp"))


# name -> (damage applied to the newest checkpoint, what its skip line must say)
DAMAGES = {
    "random bytes in tensor data": (
        lambda c: _overwrite(_shards(c)[0], at=0.5, data=random.randbytes(512)),
        "__0_0.distcp sha256 mismatch"),
    "zeroed bytes": (lambda c: _overwrite(_shards(c)[0], at=0.5, data=bytes(512)),
                     "__0_0.distcp sha256 mismatch"),
    "truncated shard": (lambda c: _truncate(_shards(c)[0]), "__0_0.distcp has"),
    "garbled shard": (lambda c: _overwrite(_shards(c)[0], at=0.0, data=random.randbytes(4096)),
                      "__0_0.distcp sha256 mismatch"),
    "truncated .metadata": (lambda c: _truncate(c / ".metadata"), ".metadata has"),
    "garbled rank_*.pt": (
        lambda c: _overwrite(c / "rank_00000.pt", at=0.0, data=random.randbytes(512)),
        "rank_00000.pt sha256 mismatch"),
    "broken train_state.json": (lambda c: (c / "train_state.json").write_text('{"step": '),
                                "train_state.json has"),
    "dir without shards": (lambda c: [p.unlink() for p in _shards(c)],
                           "__0_0.distcp is missing"),
    "manifest deleted": (lambda c: (c / manifest.MANIFEST).unlink(),
                         "no manifest.json (written by an older hpctrain?)"),
    "manifest garbled": (lambda c: _overwrite(c / manifest.MANIFEST, at=0.0, data=b"\xff{"),
                         "manifest.json is not valid JSON"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_newest_checkpoint_falls_back_bit_identically(runs, tmp_path, damage):
    run_dir = _copy(runs, tmp_path)
    apply, reason = DAMAGES[damage]
    apply(run_dir / NEWEST)
    with _Lines("hpctrain.checkpoint.save_load") as log:
        dispatch.run(make_config(OVER, run_dir=run_dir))
    skips = [ln for ln in log.lines if ln.startswith("skipping")]
    assert len(skips) == 1 and skips[0].startswith(f"skipping {NEWEST}: "), log.lines
    assert reason in skips[0], skips
    assert _losses(run_dir) == _losses(runs["full"])
    # step 4 was saved again over the damaged one; keep=2 verified checkpoints remain
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_00000004", "step_00000006"]


def test_killed_mid_save_resumes_from_the_previous_and_clears_the_leftovers(runs, tmp_path):
    """A save killed before its rename leaves step_4.partial (here with a file of a larger
    world): not a candidate, and the next save at that step starts from an empty directory."""
    run_dir = _copy(runs, tmp_path)
    partial = run_dir / (NEWEST + ".partial")
    (run_dir / NEWEST).rename(partial)
    (partial / manifest.MANIFEST).unlink()
    (partial / "rank_00007.pt").write_bytes(b"left by a killed save of 8 ranks")
    dispatch.run(make_config(OVER, run_dir=run_dir))
    assert _losses(run_dir) == _losses(runs["full"])
    assert not partial.exists()
    assert "rank_00007.pt" not in manifest.verify(run_dir / NEWEST).manifest["files"]


def test_damaged_explicit_checkpoint_stops_with_the_reason(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    DAMAGES["zeroed bytes"][0](run_dir / NEWEST)
    before = _losses(run_dir)
    with pytest.raises(ValueError, match=r"does not verify: file __0_0.distcp sha256 mismatch"
                                         r".*train.resume=never"):
        dispatch.run(make_config([*OVER, f"train.resume={run_dir / NEWEST}"], run_dir=run_dir))
    assert _losses(run_dir) == before  # nothing trained, nothing written


def test_no_verified_checkpoint_stops_instead_of_starting_over(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    for ckpt in (run_dir / "checkpoints").iterdir():
        (ckpt / manifest.MANIFEST).unlink()
    with pytest.raises(ValueError, match=r"none of the 2 checkpoints .* verifies.*"
                                         r"train.resume=never"):
        dispatch.run(make_config(OVER, run_dir=run_dir))


def test_other_model_shape_is_refused_with_the_fix(runs, tmp_path):
    run_dir = _copy(runs, tmp_path)
    with pytest.raises(ValueError, match=r"another model shape \(model.n_layers=4 in the "
                                         r"checkpoint, 2 in this run\).*train.resume=never"):
        dispatch.run(make_config([*OVER, "model.n_layers=2"], run_dir=run_dir))


class _Payload:
    """Unpickling this runs code: it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _plant(ckpt: Path, name: str, marker: Path, *, fix_manifest: bool) -> None:
    if name.endswith(".pt"):
        torch.save({"scaler": _Payload(marker)}, ckpt / name)
    else:
        (ckpt / name).write_bytes(pickle.dumps(_Payload(marker)))
    if fix_manifest:  # as an attacker who can write the directory would
        body = json.loads((ckpt / manifest.MANIFEST).read_text())
        body["files"][name] = manifest.file_digest(ckpt / name)
        (ckpt / manifest.MANIFEST).write_text(json.dumps(body))


@pytest.mark.parametrize("name", ["rank_00000.pt", ".metadata"])
@pytest.mark.parametrize("fix_manifest", [True, False], ids=["manifest-fixed", "unverified"])
def test_crafted_pickle_never_runs(runs, tmp_path, name, fix_manifest):
    run_dir = _copy(runs, tmp_path)
    marker = tmp_path / "marker"
    _plant(run_dir / NEWEST, name, marker, fix_manifest=fix_manifest)
    if fix_manifest:  # verifies, so it is read, by restricted unpicklers: refused, and the
        # run falls back to the previous checkpoint as for any damage (one line, no advice)
        refusal = ("Unsupported global: GLOBAL exec" if name.endswith(".pt")
                   else "builtins.exec is not part of a DCP index")
        with _Lines("hpctrain.checkpoint.save_load") as log:
            dispatch.run(make_config(OVER, run_dir=run_dir))
        skips = [ln for ln in log.lines if ln.startswith("skipping")]
        assert len(skips) == 1 and skips[0].startswith(f"skipping {NEWEST}: "), log.lines
        assert f"refused to load it (UnpicklingError: {refusal})" in skips[0], skips
        assert "weights_only=False" not in skips[0]
        with pytest.raises(ValueError, match=r"verifies but rank 0 refused to load it "
                                             rf"\(UnpicklingError: {refusal}\)"):
            _plant(run_dir / NEWEST, name, marker, fix_manifest=True)  # saved again: re-plant
            dispatch.run(make_config([*OVER, f"train.resume={run_dir / NEWEST}"],
                                  run_dir=run_dir))  # an explicit checkpoint stops
    else:  # never unpickled at all: skipped like any damage
        dispatch.run(make_config(OVER, run_dir=run_dir))
    assert _losses(run_dir) == _losses(runs["full"])
    assert not marker.exists()
    if fix_manifest:  # the payload is live: a plain unpickler would have run it
        planted = run_dir / NEWEST / name
        _ = (torch.load(planted, weights_only=False) if name.endswith(".pt")
             else pickle.loads(planted.read_bytes()))
        assert marker.exists()


DP2 = ["parallel=dp2", "train.checkpoint_every=2"]


def _dp2_run(overrides: list[str], run_dir: str) -> int:
    return len(run_trainer([*DP2, *overrides], run_dir, steps=6).history)


def test_dp2_ranks_agree_on_the_fallback(world2, tmp_path):
    """Only rank 1 reads rank_00001.pt: if ranks verified on their own, they would diverge."""
    world2.run(_dp2_run, [], str(tmp_path / "full"))
    split = tmp_path / "split"
    world2.run(_dp2_run, ["train.stop_after=4"], str(split))
    _overwrite(split / NEWEST / "rank_00001.pt", at=0.5, data=random.randbytes(64))
    steps_run = world2.run(_dp2_run, [], str(split))
    assert steps_run == [4, 4]  # both resumed from step 2
    assert _losses(split) == _losses(tmp_path / "full")
    assert os.path.exists(split / "checkpoints" / "step_00000006" / "rank_00001.pt")

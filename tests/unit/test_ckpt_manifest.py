"""The checkpoint manifest and the catalog built on it: every file is hashed, every kind of
tampering is named, the model-shape check, and pruning that keeps the fallback of a suspect
checkpoint. Fake checkpoint directories (bytes, no torch) keep these fast."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from hpctrain.checkpoint import catalog, manifest
from hpctrain.checkpoint.manifest import Unverified
from hpctrain.models.config import ModelConfig

FILES = {".metadata": b"index" * 10, "__0_0.distcp": os.urandom(3000),
         "rank_00000.pt": b"rng" * 7, "train_state.json": b'{"step": 3}'}
MODEL = ModelConfig(name="t", vocab_size=300, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                    ffn_dim=32, max_seq_len=64)


def fake_checkpoint(directory: Path, *, step: int = 3) -> Path:
    directory.mkdir(parents=True)
    for name, data in FILES.items():
        (directory / name).write_bytes(data)
    files = manifest.digest_files(directory, names=list(FILES))
    manifest.write(directory, files=files, step=step, layout={"dp": 1}, model=MODEL)
    return directory


def test_digest_is_sha256_of_the_whole_file_across_chunks(tmp_path, monkeypatch):
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(manifest, "_CHUNK", 4096)  # several chunks, the last one partial
    assert manifest.file_digest(tmp_path / "f") == {
        "size": 10_000, "sha256": hashlib.sha256(data).hexdigest()}


def test_manifest_lists_every_file_and_verifies(tmp_path):
    path = fake_checkpoint(tmp_path / "step_00000003")
    body = json.loads((path / manifest.MANIFEST).read_text())
    assert sorted(body["files"]) == sorted(FILES)
    assert body["model"]["dim"] == 16 and body["layout"] == {"dp": 1}
    found = manifest.verify(path)
    assert found.step == 3 and found.path == path


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(path: Path, edit) -> None:
    body = json.loads((path / manifest.MANIFEST).read_text())
    edit(body)
    (path / manifest.MANIFEST).write_text(json.dumps(body))


TAMPERS = {
    "flipped byte": (lambda p: _flip(p / "__0_0.distcp"), "__0_0.distcp sha256 mismatch"),
    "truncated": (lambda p: (p / ".metadata").write_bytes(b"ind"), ".metadata has 3 bytes"),
    "missing": (lambda p: (p / "rank_00000.pt").unlink(), "rank_00000.pt is missing"),
    "no manifest": (lambda p: (p / manifest.MANIFEST).unlink(), "older hpctrain"),
    "garbled manifest": (lambda p: (p / manifest.MANIFEST).write_text("{\"files"),
                         "not valid JSON"),
    "foreign manifest": (lambda p: (p / manifest.MANIFEST).write_text("[1, 2]"),
                         "not an hpctrain manifest"),
    "path in manifest": (lambda p: _edit_manifest(
        p, lambda b: b["files"].update({"../x": {"size": 1, "sha256": "0"}})),
        "malformed entry '../x'"),
    "required not listed": (lambda p: _edit_manifest(
        p, lambda b: b["files"].pop(".metadata")), "lists no .metadata"),
    "wrong step": (lambda p: _edit_manifest(p, lambda b: b.update(step=9)),
                   "says step 9, the directory's name step 3"),
}


@pytest.mark.parametrize("tamper", TAMPERS)
def test_every_tampering_is_named(tmp_path, tamper):
    damage, reason = TAMPERS[tamper]
    path = fake_checkpoint(tmp_path / "step_00000003")
    damage(path)
    with pytest.raises(Unverified) as err:
        catalog.verify(path)
    assert reason in str(err.value)


def test_stray_files_are_ignored_and_named_never_read(tmp_path, caplog):
    """Issue 45: one stray file made a good checkpoint unusable (a 10-step rollback). Every
    listed file still verifies; the strays are named in a warning, and a load reads listed
    files only (a stray rank_00003.pt is not this rank's state)."""
    path = fake_checkpoint(tmp_path / "step_00000003")
    (path / "notes.txt").write_text("x")
    (path / "rank_00003.pt").write_bytes(b"not a checkpoint's")
    (path / "sub").mkdir()
    with caplog.at_level("WARNING"):
        assert catalog.verify(path).step == 3
    assert "notes.txt, rank_00003.pt, sub" in caplog.text and "never read" in caplog.text
    assert "rank_00003.pt" not in manifest.listed(path)


def test_shape_mismatch_names_only_shape_keys():
    saved = {"model": {**MODEL.__dict__}}
    assert manifest.shape_mismatch(saved, model=MODEL) == []
    assert manifest.shape_mismatch({"model": None}, model=MODEL) == []
    other = MODEL.with_(n_layers=4, rope_theta=5.0, name="x")
    assert manifest.shape_mismatch(saved, model=other) == [
        "model.n_layers=2 in the checkpoint, 4 in this run"]


def test_scan_returns_the_newest_verified_and_the_skipped(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        fake_checkpoint(root / f"step_{step:08d}", step=step)
    _flip(root / "step_00000003" / "__0_0.distcp")
    (root / "step_00000004.partial").mkdir()  # a killed save: not a candidate
    found, skipped = catalog.scan(tmp_path)
    assert found.path.name == "step_00000002"
    assert [(p.name, "sha256 mismatch" in r) for p, r in skipped] == [("step_00000003", True)]


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_prune_keeps_the_fallback_of_a_suspect_and_counts_verified(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 7):
        fake_checkpoint(root / f"step_{step:08d}", step=step)
    _flip(root / "step_00000003" / "__0_0.distcp")  # suspect: 2 is its fallback
    (root / "step_00000004" / manifest.MANIFEST).unlink()  # an older hpctrain's: suspect too
    (root / "step_00000001.partial").mkdir()  # killed saves: earlier ones go, later stay
    (root / "step_00000009.partial").mkdir()
    catalog.prune(root, keep=1, newest=root / "step_00000006")
    assert _steps(root) == ["step_00000002", "step_00000003", "step_00000004",
                            "step_00000006", "step_00000009.partial"]


def test_prune_keeps_keep_verified_and_never_the_just_saved_one_less(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 5):
        fake_checkpoint(root / f"step_{step:08d}", step=step)
    catalog.prune(root, keep=2, newest=root / "step_00000004")
    assert _steps(root) == ["step_00000003", "step_00000004"]
    catalog.prune(root, keep=2, newest=root / "step_00000003")  # re-saved an older step
    assert _steps(root) == ["step_00000003", "step_00000004"]
    catalog.prune(root, keep=0, newest=root / "step_00000004")  # 0 keeps all
    assert _steps(root) == ["step_00000003", "step_00000004"]


def test_keep_every_checkpoints_are_kept_for_good(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 9):
        fake_checkpoint(root / f"step_{step:08d}", step=step)
        catalog.prune(root, keep=2, keep_every=3, newest=root / f"step_{step:08d}")
    assert _steps(root) == ["step_00000003", "step_00000006", "step_00000007", "step_00000008"]
    catalog.prune(root, keep=1, keep_every=0, newest=root / "step_00000008")  # 0: none kept
    assert _steps(root) == ["step_00000008"]


def test_prune_notices_damage_done_after_it_last_looked(tmp_path):
    """The verification memo is keyed by the files' stat: a changed file is re-verified."""
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        fake_checkpoint(root / f"step_{step:08d}", step=step)
    catalog.scan(tmp_path)  # remembers 3 as verified
    _flip(root / "step_00000003" / "__0_0.distcp")
    fake_checkpoint(root / "step_00000004", step=4)
    catalog.prune(root, keep=1, newest=root / "step_00000004")
    assert _steps(root) == ["step_00000002", "step_00000003", "step_00000004"]


def test_shares_cover_every_file_once_balanced_by_size():
    files = {n: {"size": s, "sha256": ""} for n, s in
             [("a", 100), ("b", 90), ("c", 10), ("d", 5), ("e", 5), ("f", 0)]}
    parts = manifest.shares(files, world=2)
    assert sorted(n for part in parts for n in part) == sorted(files)
    loads = [sum(files[n]["size"] for n in part) for part in parts]
    assert loads == [105, 105]
    assert manifest.shares(files, world=4) == [["a"], ["b"], ["c", "f"], ["d", "e"]]
    assert manifest.shares(files, world=1) == [["a", "b", "c", "d", "e", "f"]]


def test_milestones_stay_when_keep_every_changes(tmp_path):
    """Issue 45: changing train.keep_every on resume deleted the checkpoints kept for good under
    the old value. A milestone's manifest says so (`kept`), and pruning keeps it."""
    root = tmp_path / "checkpoints"
    for step in (2, 3, 4, 5, 6):
        path = fake_checkpoint(root / f"step_{step:08d}", step=step)
        if step % 2 == 0:  # saved under train.keep_every=2
            _edit_manifest(path, lambda b: b.update(kept=True))
    catalog.prune(root, keep=1, newest=root / "step_00000006", keep_every=5)
    assert sorted(p.name for p in root.iterdir()) == [
        "step_00000002", "step_00000004", "step_00000005", "step_00000006"]

"""A checkpoint's manifest: the size and sha256 of every file in its directory, its layout,
step and model shape. A checkpoint counts as complete only when its manifest verifies.

`manifest.json` is written last (by rank 0, before the directory is renamed into place) and read
back as plain JSON. `verify` reads bytes and hashes them; it never unpickles anything, so an
unverified directory's files are never handed to a loader. The digests of a file are a pure
function of its bytes: a rank hashes the files it wrote (they are still in its page cache) and
rank 0 merges the digests (hpctrain.checkpoint.save_load).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.models.config import ModelConfig

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 4 << 20  # bytes per read: large enough that hashing, not syscalls, sets the pace
# Files every hpctrain checkpoint has: DCP's index, the step, rank 0's RNG/scaler state.
_REQUIRED = (".metadata", "train_state.json", "rank_00000.pt")
# ModelConfig fields that set a parameter's shape (the others change numerics, not shapes).
SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
              "tied_embeddings")


class Unverified(Exception):
    """The directory is not a verified checkpoint; str(err) is the reason, one line."""


@dataclass(frozen=True)
class Verified:
    """A checkpoint directory whose every file matched its manifest when it was checked."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def file_digest(path: Path) -> dict[str, Any]:
    """{"size", "sha256"} of one file, streamed in 4 MiB chunks (constant memory)."""
    h, size = hashlib.sha256(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return {"size": size, "sha256": h.hexdigest()}


def digest_files(directory: Path, *, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_digest(Path(directory) / name) for name in sorted(names)}


def write(directory: Path, *, files: dict[str, dict[str, Any]], step: int,
          layout: dict[str, int], model: ModelConfig | None, kept: bool = False) -> Path:
    """Write `manifest.json` (through a temp file and a rename, so it is whole or absent).
    `kept`: a milestone, kept for good (train.keep_every when it was saved) whatever the
    retention of later runs says."""
    body = {"format": FORMAT, "step": step, "layout": layout,
            "model": dataclasses.asdict(model) if model is not None else None,
            "hash": "sha256", "kept": kept, "files": dict(sorted(files.items()))}
    path = Path(directory) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def verify(directory: Path) -> Verified:
    """Check every file of `directory` against its manifest: present, listed, same size and
    sha256. Raises `Unverified` with the first problem found (sizes are compared before any
    file is hashed, so a truncated or missing file is reported without reading the rest)."""
    body = check_layout(directory)
    check_digests(directory, body, names=sorted(body["files"]))
    return Verified(Path(directory), body)


def check_layout(directory: Path) -> dict[str, Any]:
    """Everything but the hashes: the manifest parses, lists the required files, and the
    directory holds exactly its files at their sizes. Returns the manifest."""
    directory = Path(directory)
    try:
        body = _read_manifest(directory)
        files = body["files"]
        for name in _REQUIRED:
            if name not in files:
                raise Unverified(f"{MANIFEST} lists no {name}")
        _check_listing(directory, files)
        for name, entry in files.items():
            size = (directory / name).stat().st_size
            if size != entry["size"]:
                raise Unverified(f"file {name} has {size} bytes, {MANIFEST} says "
                                 f"{entry['size']} (truncated or overwritten)")
    except OSError as err:
        raise Unverified(f"cannot read {err.filename}: {err.strerror}") from None
    return body


def check_digests(directory: Path, body: dict[str, Any], *, names: list[str]) -> None:
    """Hash `names` (files listed in `body`) and compare; raises `Unverified` on a mismatch."""
    for name in names:
        try:
            digest = file_digest(Path(directory) / name)["sha256"]
        except OSError as err:
            raise Unverified(f"cannot read {name}: {err.strerror}") from None
        if digest != body["files"][name]["sha256"]:
            raise Unverified(f"file {name} sha256 mismatch (its bytes changed after the save)")


def shares(files: dict[str, dict[str, Any]], *, world: int) -> list[list[str]]:
    """Split the files over `world` ranks for hashing, balanced by size (largest first to
    the least loaded rank; ties by name): a pure function, so every rank computes the same."""
    load, out = [0] * world, [[] for _ in range(world)]
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += files[name]["size"]
        out[r].append(name)
    return out


def _read_manifest(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise Unverified("no such directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise Unverified(f"no {MANIFEST} (written by an older hpctrain?)")
    try:
        body = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise Unverified(f"{MANIFEST} is not valid JSON ({err})") from None
    ok = (isinstance(body, dict) and body.get("format") == FORMAT
          and isinstance(body.get("files"), dict) and isinstance(body.get("step"), int))
    if not ok:
        raise Unverified(f"{MANIFEST} is not an hpctrain manifest of format {FORMAT}")
    for name, entry in body["files"].items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str) or Path(name).name != name
                or name in ("", ".", "..", MANIFEST)):
            raise Unverified(f"{MANIFEST} has a malformed entry {name!r}")
    return body


def _check_listing(directory: Path, files: dict[str, Any]) -> None:
    """The directory holds every listed file, each a regular file. Anything else in it is
    not part of the checkpoint: never read (a load reads listed files only, `listed`), so it
    is named in a warning, and a good checkpoint stays usable (one stray file made the run
    fall back to an older one)."""
    present = {}
    with os.scandir(directory) as entries:
        for e in entries:
            if e.name != MANIFEST:
                present[e.name] = e.is_file(follow_symlinks=False)
    for name in sorted(files):
        if name not in present:
            raise Unverified(f"file {name} is missing")
        if not present[name]:
            raise Unverified(f"{name} is not a regular file")
    extra = sorted(set(present) - set(files))
    if extra:
        log.warning("checkpoint %s holds %s, not in its %s: ignored (never read)", directory,
                    ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5
                                            else ""), MANIFEST)


def listed(directory: Path) -> set[str]:
    """The files a checkpoint's manifest lists (what a load may read)."""
    return set(json.loads((Path(directory) / MANIFEST).read_text())["files"])


def shape_mismatch(manifest: dict[str, Any], *, model: ModelConfig) -> list[str]:
    """`model.<key>=<saved> in the checkpoint, <now> in this run` for each shape key that
    differs; [] when the shapes agree or the manifest records no model."""
    saved = manifest.get("model")
    if not isinstance(saved, dict):
        return []
    now = dataclasses.asdict(model)
    return [f"model.{k}={saved.get(k)!r} in the checkpoint, {now[k]!r} in this run"
            for k in SHAPE_KEYS if saved.get(k) != now[k]]

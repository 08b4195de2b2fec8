"""The checkpoints of one run directory: which verify, which is the newest good one, which to
delete, and whether train.resume names one. Everything here is local to the calling process (no
collectives); save_load.py builds the collective decision (one outcome on every rank) from
`check_layout` and hashed shares.

Verification hashes every file, so its outcome is remembered per directory together with a
stat signature of its files (name, size, mtime, inode): pruning after each save then hashes
only checkpoints it has not seen in this process. Choosing what to load never uses the memo.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from hpctrain.checkpoint import manifest
from hpctrain.checkpoint.manifest import Unverified, Verified
from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.distributed import rundir

log = logging.getLogger(__name__)

NAME = rundir.CHECKPOINT
PARTIAL = re.compile(r"^step_(\d{8})\.partial$")

RESUME_MODES = ("auto", "never")

Signature = tuple[tuple[str, int, int, int], ...]
_seen: dict[Path, tuple[Signature, str | None]] = {}  # directory -> (signature, reason|None)


def candidates(run_dir: Path) -> list[Path]:
    """Renamed (not `.partial`) checkpoint directories, newest first."""
    return rundir.checkpoints(run_dir)


def verify(path: Path) -> Verified:
    """`manifest.verify` plus the step in the directory's name; raises `Unverified`."""
    path = Path(path)
    try:
        body = check_layout(path)
        manifest.check_digests(path, body, names=sorted(body["files"]))
    except Unverified as err:
        remember(path, reason=str(err))
        raise
    remember(path, reason=None)
    return Verified(path, body)


def check_layout(path: Path) -> dict[str, Any]:
    """`manifest.check_layout` (no hashing) plus the step in the directory's name."""
    body = manifest.check_layout(path)
    named = NAME.match(Path(path).name)
    if named and int(named[1]) != body["step"]:
        raise Unverified(f"{manifest.MANIFEST} says step {body['step']}, the directory's "
                         f"name step {int(named[1])}")
    return body


def scan(run_dir: Path) -> tuple[Verified | None, list[tuple[Path, str]]]:
    """The newest verified checkpoint (or None) and every newer one skipped, with its
    reason. Checkpoints older than the one found are not read."""
    skipped = []
    for path in candidates(run_dir):
        try:
            return verify(path), skipped
        except Unverified as err:
            skipped.append((path, str(err)))
    return None, skipped


def remember(path: Path, *, reason: str | None) -> None:
    """Record the outcome of a verification (None: verified) against the files' stat."""
    try:
        _seen[Path(path).resolve()] = (_signature(path), reason)
    except OSError:
        pass  # vanished meanwhile: nothing to remember


def _signature(path: Path) -> Signature:
    with os.scandir(path) as entries:
        stats = [(e.name, e.stat(follow_symlinks=False)) for e in entries]
    return tuple(sorted((n, s.st_size, s.st_mtime_ns, s.st_ino) for n, s in stats))


def known_reason(path: Path) -> str | None:
    """Why `path` does not verify (None: it does), from the memo when its files have not
    changed since, else by verifying it (and logging a newly found failure)."""
    hit = _seen.get(Path(path).resolve())
    try:
        if hit is not None and hit[0] == _signature(path):
            return hit[1]
    except OSError as err:
        return str(err)
    try:
        verify(path)
    except Unverified as err:
        log.warning("checkpoint %s does not verify: %s", path, err)
        return str(err)
    return None


def _milestone(path: Path) -> bool:
    """Whether a verified checkpoint was saved as a milestone (its manifest's `kept`)."""
    try:
        return json.loads((path / "manifest.json").read_text()).get("kept") is True
    except (OSError, ValueError, AttributeError):
        return False


def prune(root: Path, *, keep: int, newest: Path, keep_every: int = 0) -> None:
    """After saving `newest`: keep it, the `keep` newest verified checkpoints, every one at a
    multiple of `keep_every` steps or saved as a milestone under an earlier value (its
    manifest's `kept`: kept for good; 0: none), every unverified one (for
    inspection, and it may be overwritten by a later save at its step) and the newest verified
    one before each unverified one (the fallback it needs); delete the other verified ones,
    and `.partial` directories of earlier steps (killed saves). keep=0 keeps everything."""
    if keep <= 0:
        return
    dirs = sorted(p for p in root.iterdir() if NAME.match(p.name))
    reasons = {p: known_reason(p) for p in dirs}
    verified = [p for p in dirs if reasons[p] is None]
    keepers = {newest, *verified[-keep:], *(p for p in verified if _milestone(p))}
    if keep_every > 0:
        keepers.update(p for p in verified if int(NAME.match(p.name)[1]) % keep_every == 0)
    for suspect in (p for p in dirs if reasons[p] is not None):
        before = [p for p in verified if p.name < suspect.name]
        keepers.update(before[-1:])
    for p in verified:
        if p not in keepers:
            shutil.rmtree(p, ignore_errors=True)
    named = NAME.match(newest.name)
    for p in root.iterdir():
        stale = PARTIAL.match(p.name)
        if named and stale and int(stale[1]) < int(named[1]):
            shutil.rmtree(p, ignore_errors=True)


@check("train.resume", stage="input", data=True)
def check_resume(c: Config) -> list[str]:
    """train.resume: auto, never, or a directory holding a saved checkpoint."""
    mode = c.train.resume
    if mode in RESUME_MODES:
        return []
    path = Path(mode).expanduser()
    if path.is_dir() and (path / "train_state.json").is_file():
        return []
    close = difflib.get_close_matches(mode, RESUME_MODES, n=1, cutoff=0.5)
    if close and not path.exists():
        return [f"train.resume={mode!r} is not auto, never or an existing checkpoint "
                f"directory: did you mean train.resume={close[0]}?"]
    saved = sorted(p.parent for p in path.glob("checkpoints/step_*/train_state.json"))
    if saved:
        return [f"train.resume={mode!r} is a run directory, not a checkpoint: pass "
                f"train.resume={saved[-1]} (its newest)"]
    why = ("no such directory" if not path.exists() else
           "a file, not a directory" if not path.is_dir() else
           "no train_state.json in it, so not a saved checkpoint")
    return [f"train.resume={mode!r}: {why}; pass a checkpoint directory such as "
            "<run_dir>/checkpoints/step_00000100, or train.resume=auto (the newest in this "
            "run directory) or train.resume=never"]


@check("hydra.run.dir", stage="input", data=True)
def check_run_dir(c: Config) -> list[str]:
    """The run directory is no part of another run's checkpoints: that run's retention would
    delete it and its resume read it (a run placed in checkpoints/step_* made that run fall
    back 10 steps)."""
    run_dir = Path(c.run_dir).expanduser().absolute()
    for folder in run_dir.parents:
        if folder.name == "checkpoints" and (folder.parent / ".hydra").is_dir():
            return [f"hydra.run.dir={c.run_dir} is inside {folder}, the checkpoints of the run "
                    f"{folder.parent}, whose retention and resume own everything there: "
                    f"choose a directory outside it, e.g. hydra.run.dir={folder.parent}_next"]
    return []


def set_aside_newer(run_dir: Path, *, step: int) -> Path | None:
    """A run resumed from an earlier checkpoint (train.resume=<dir>) starts a new line: this
    run directory's checkpoints after `step` belong to the abandoned one. They move, whole,
    into `checkpoints/abandoned_after_<step>_<time>/` (no longer candidates): `resume=auto`
    then follows the new line and pruning keeps its checkpoints, and nothing is deleted.
    Returns the folder they went to (None: there were none)."""
    newer = [p for p in candidates(run_dir) if int(NAME.match(p.name)[1]) > step]
    if not newer:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = Path(run_dir) / "checkpoints" / f"abandoned_after_{step:08d}_{stamp}"
    aside.mkdir()
    for path in newer:
        os.replace(path, aside / path.name)
    log.warning("resumed at step %d, an earlier checkpoint: the %d newer checkpoint(s) of the "
                "line it leaves (%s) moved to %s, where they stay", step, len(newer),
                ", ".join(p.name for p in sorted(newer)), aside)
    return aside

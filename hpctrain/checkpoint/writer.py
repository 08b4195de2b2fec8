"""Writing checkpoints: every rank its own shards, synchronously or in the background.

A save (collective, at one step on every rank):
  1. waits for the previous save, if one is in flight (at most one is);
  2. cuts this rank's state into chunks (`ckpt_shards`): views of the optimizer's own buffers,
     or — asynchronous — a staged copy of them (one host copy of the rank's shard, pinned on
     CUDA, reused by later saves), so training may change the buffers meanwhile;
  3. writes them with `dcp.save` into `step_N.partial/`, then the rank's RNG/scaler file, and
     hashes what it wrote;
  4. all-gathers every rank's outcome: if all wrote, rank 0 writes the manifest and renames the
     directory (`seal`), then prunes; if any failed, every rank holds the same error naming
     the rank, the directory and the reason, the `.partial` is removed and the checkpoints
     before it are untouched.

Steps 3–4 run on a thread of their own and over the mesh's `io` group (gloo, the whole world),
so their collectives never interleave with the training thread's. The training thread learns
the outcome at an agreed step: `poll` (every step while a save is in flight) all-reduces
"done" over the world, so every rank finishes the save, or raises its error, after the same
step. `wait` blocks until the save is sealed (before the next save, a rollback, and the end).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpctrain.checkpoint import catalog, manifest
from hpctrain.checkpoint.planners import ChunkSavePlanner
from hpctrain.checkpoint.shards import Chunk
from hpctrain.errors import RunStopped

log = logging.getLogger(__name__)

LAYOUT_KEYS = ("dp", "cp", "tp", "pp", "ep", "zero")


class CheckpointWriteError(RunStopped):
    """A save failed on some rank; the same message on every rank (one line, no traceback).
    The checkpoints before it are intact."""


@dataclass(frozen=True)
class Retention:
    """`keep` newest verified checkpoints (0: all), and every checkpoint whose step is a
    multiple of `keep_every` (0: none) for good."""

    keep: int = 2
    keep_every: int = 0


@dataclass
class Job:
    """One save in flight, as the training thread knows it."""

    path: Path
    step: int
    future: Future


@dataclass(frozen=True)
class Request:
    """Everything the writing thread needs, owned by it (no reference into training state)."""

    path: Path
    chunks: list[Chunk]
    rank_state: dict[str, Any]
    train_state: dict[str, Any]
    model: Any
    retention: Retention


def partial_of(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def write(request: Request, *, group) -> dict[str, float]:
    """Collective over `group` (every rank of the world): steps 3–4 of the module docstring.
    Returns this rank's {ckpt_background_s, ckpt_bytes, ckpt_mb_per_s, ckpt_sealed_at (Unix
    seconds)}; raises CheckpointWriteError (on every rank alike) when any rank failed."""
    start = time.perf_counter()
    partial, rank = partial_of(request.path), dist.get_rank(group)
    planner = ChunkSavePlanner(request.chunks)
    error, digests = None, None
    try:
        dcp.save({}, checkpoint_id=str(partial), planner=planner, process_group=group)
        torch.save(request.rank_state, partial / f"rank_{rank:05d}.pt")
        digests = manifest.digest_files(partial, names=_written_by(partial, rank=rank))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - every rank hears of it
        error = reason(err, rank=rank)
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, (error, digests, planner.planned_bytes), group=group)
    failed = [e for e, _, _ in outcomes if e is not None]
    sealed = None if failed else _seal_on_rank0(request, [d for _, d, _ in outcomes], rank=rank)
    box = [sealed]
    dist.broadcast_object_list(box, group=group, group_src=0)
    if failed or box[0] is not None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(_failure(request.path, failed[0] if failed else box[0],
                                            needed=sum(b for _, _, b in outcomes)))
    seconds = time.perf_counter() - start
    written = planner.written_bytes
    return {"ckpt_background_s": seconds, "ckpt_bytes": written,
            "ckpt_mb_per_s": written / 1e6 / max(seconds, 1e-9), "ckpt_sealed_at": time.time()}


def _failure(path: Path, why: str, *, needed: int) -> str:
    """The one message of a failed save: where, why, the free space, the fix. torch's own
    error for a full disk can be cryptic ("unexpected pos"), so the free space is compared
    with what the save writes."""
    blocker = next((p for p in (partial_of(path), path, *path.parents)
                    if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # no space or permission fix applies: a file is in the way
        return (f"saving checkpoint {path} failed ({why}): {blocker} is a file where a "
                "directory must be; move or delete it, then run the same command again (the "
                "checkpoints before it are intact and a resume starts from the newest)")
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    space = "" if free is None else f"{free / 1e6:.1f} MB free on its filesystem"
    if free is not None and free < needed and "No space left" not in why:
        space += f" where this save writes up to {needed / 1e6:.1f} MB: No space left on device"
    return (f"saving checkpoint {path} failed ({why}){'; ' + space if space else ''}; the "
            "checkpoints before it are intact and a resume starts from the newest: free space "
            "or make the directory writable (or lower train.keep, or set hydra.run.dir on a "
            "larger disk), then run the same command again")


def _seal_on_rank0(request: Request, digests: list[dict], *, rank: int) -> str | None:
    """Rank 0: seal and prune; the reason it failed, or None (every rank: None)."""
    if rank != 0:
        return None
    try:
        seal(partial_of(request.path), request.path, digests=digests,
             train_state=request.train_state, model=request.model,
             keep_every=request.retention.keep_every)
    except OSError as err:
        return reason(err, rank=0)
    catalog.prune(request.path.parent, keep=request.retention.keep,
                  keep_every=request.retention.keep_every, newest=request.path)
    return None


def seal(partial: Path, path: Path, *, digests: list[dict], train_state: dict[str, Any],
         model, keep_every: int = 0) -> None:
    """After every rank's files are written and hashed: train_state.json, then manifest.json
    over every file (a milestone of `keep_every` marked kept), then the rename that makes the
    checkpoint visible."""
    (partial / "train_state.json").write_text(json.dumps(train_state, indent=2))
    files = {name: entry for d in digests for name, entry in d.items()}
    unclaimed = sorted(set(os.listdir(partial)) - set(files))  # train_state.json, or renamed
    files.update(manifest.digest_files(partial, names=unclaimed))
    layout = {k: train_state[k] for k in LAYOUT_KEYS if k in train_state}
    step = train_state["step"]
    manifest.write(partial, files=files, step=step, layout=layout, model=model,
                   kept=keep_every > 0 and step % keep_every == 0)
    if path.exists():
        shutil.rmtree(path)
    os.replace(partial, path)
    catalog.remember(path, reason=None)


def _written_by(directory: Path, *, rank: int) -> list[str]:
    """The files this rank wrote, by DCP's and our naming (`__<rank>_<i>.distcp`, rank 0's
    `.metadata`, `rank_<rank>.pt`). Rank 0 hashes whatever no rank claims, so a change in
    DCP's naming costs speed, never correctness."""
    own = re.compile(rf"^__{rank}_\d+\.distcp$")
    mine = {f"rank_{rank:05d}.pt", *([".metadata"] if rank == 0 else [])}
    return [n for n in os.listdir(directory) if n in mine or own.match(n)]


def reason(err: BaseException, *, rank: int | None = None) -> str:
    """One line: "rank R: <Type>: <first line>" — for a DCP CheckpointException (whose own
    text is every rank's traceback) the first failing rank's exception, else `err` on `rank`."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        failing, inner = min(failures.items())
        inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback)
        return reason(inner, rank=failing)
    text = (str(err).splitlines() or [""])[0][:300]
    where = "" if rank is None else f"rank {rank}: "
    return f"{where}{type(err).__name__}: {text}"

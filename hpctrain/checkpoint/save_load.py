"""Sharded checkpoints in torch.distributed.checkpoint (DCP) format: written atomically,
verified before anything in them is read, pruned without losing the last good one.

A checkpoint is `<run_dir>/checkpoints/step_XXXXXXXX/`: DCP chunks of the model and optimizer
under the single-process model's names and shapes, each written by the one rank that owns it
(`ckpt_shards`: its ZeRO shard of its tp/ep slice of its stage, nothing gathered), one
`rank_XXXXX.pt` per rank (RNG and loss-scaler state), `train_state.json` (step, layout) and
`manifest.json` (size and sha256 of every other file, layout, model shape — see `manifest`).
Ranks write into `step_XXXXXXXX.partial/` and hash the files they wrote; rank 0 writes the
manifest last and renames the directory (`ckpt_writer`, also in the background:
`checkpointer`). Only a renamed directory whose manifest verifies is a checkpoint, so a crash
mid-save, a damaged file or a checkpoint of an older hpctrain is never loaded. Loading reads,
into each rank's own buffers, only the ranges of the stored chunks that overlap what the rank
owns under the current layout (`ckpt_dcp`), so any dp/tp/pp/cp/ep/ZeRO layout resumes any
other, and checkpoints written before sharding (one whole tensor per key) load the same way.

Verification is collective when resuming: rank 0 checks the manifest, every rank hashes a share
of the files and all ranks see every outcome, so every rank loads the same checkpoint. Files are
unpickled only after verification, and only with restricted unpicklers (`safe_dcp`,
`weights_only=True`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hpctrain.checkpoint import catalog, manifest, safe_load, writer
from hpctrain.checkpoint.checkpointer import Checkpointer
from hpctrain.checkpoint.manifest import Unverified, Verified
from hpctrain.checkpoint.planners import ChunkLoadPlanner
from hpctrain.checkpoint.shards import Chunk, optimizer_flats, state_path, unit_chunks
from hpctrain.checkpoint.writer import Retention
from hpctrain.models.config import ModelConfig
from hpctrain.parallel.data.state import refresh_from_masters
from hpctrain.parallel.state import ParallelState

log = logging.getLogger(__name__)
T = TypeVar("T")

_FIX = ("resume from another checkpoint (train.resume=<dir>; train.resume=auto picks the "
        "newest that verifies) or start over with train.resume=never")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


# -- choosing a checkpoint ---------------------------------------------------------------------
def _log_skipped(run_dir: Path, *, skipped: list[tuple[Path, str]]) -> None:
    for path, reason in skipped:
        log.warning("skipping %s: %s", path.relative_to(run_dir), reason)


def latest_complete(run_dir: Path) -> Path | None:
    """The newest *verified* checkpoint under `run_dir`, or None; logs one line per newer
    checkpoint skipped. Local (not collective; this process hashes every file): to have every
    rank use one checkpoint, call `agreed_latest` (or pass the path to `load`, which verifies
    collectively)."""
    found, skipped = catalog.scan(Path(run_dir))
    _log_skipped(Path(run_dir), skipped=skipped)
    return found.path if found is not None else None


class Refused(ValueError):
    """A checkpoint that verifies, but whose content a restricted loader refused (files
    changed along with the manifest, or another torch's): a resume that chose it on its own
    (train.resume=auto) falls back to the one before it."""


def agreed_latest(run_dir: Path, *, refused: tuple[str, ...] = ()) -> Verified | None:
    """Collective: the newest checkpoint that verifies (`agreed_check`), the same on every
    rank, passing over the names in `refused`; None when there is none. Rank 0 logs each
    newer one skipped. Checkpoints exist but none verifies: ValueError on every rank
    (starting over silently would discard the run's progress)."""
    run_dir = Path(run_dir)
    names = _from_rank0(lambda: [p.name for p in catalog.candidates(run_dir)
                                 if p.name not in refused])
    skipped: list[tuple[Path, str]] = []
    for name in names:
        path = run_dir / "checkpoints" / name
        try:
            found = agreed_check(path)
            break
        except Unverified as err:
            skipped.append((path, str(err)))
    else:
        found = None
    if dist.get_rank() == 0:
        _log_skipped(run_dir, skipped=skipped)
    if found is None and (skipped or refused):
        raise ValueError(
            f"none of the {len(skipped) + len(refused)} checkpoints in "
            f"{run_dir / 'checkpoints'} verifies and loads (reasons logged above): start over "
            "with train.resume=never (they are kept), or use another run directory")
    return found


def load_latest(run_dir: Path, *, parallel: ParallelState, model_config: ModelConfig | None = None,
                accept: Callable[[Verified, dict[str, Any]], None] | None = None
                ) -> tuple[Verified, dict[str, Any], dict[str, Any]] | None:
    """Collective: `load` the newest checkpoint of `run_dir` that verifies and loads, falling
    back past one a loader refuses (`Refused`: one log line each, as for any damage); None
    when the run has none. Another model shape still stops (ValueError)."""
    refused: tuple[str, ...] = ()
    while (found := agreed_latest(run_dir, refused=refused)) is not None:
        try:
            return (found, *load(found, parallel=parallel, model_config=model_config,
                                 accept=accept))
        except Refused as err:
            if dist.get_rank() == 0:
                log.warning("skipping %s: %s", found.path.relative_to(Path(run_dir)), err)
            refused += (found.path.name,)
    return None


def agreed_verified(path: Path) -> Verified:
    """Collective: `path` verified (`agreed_check`); ValueError on every rank, naming the
    reason, when it does not verify."""
    try:
        return agreed_check(Path(path))
    except Unverified as err:
        raise ValueError(f"checkpoint {path} does not verify: {err}: {_FIX}") from None


def agreed_check(path: Path) -> Verified:
    """Collective verification with one outcome on every rank: rank 0 checks the manifest,
    listing and sizes and broadcasts the manifest; each rank hashes its share of the files
    (`manifest.shares`, balanced by size); every rank's outcome is all-gathered, so all raise
    the same `Unverified` or return the same `Verified`. Nothing is unpickled."""
    head = _from_rank0(lambda: _layout_or_reason(path))
    if isinstance(head, str):
        raise Unverified(head)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        manifest.check_digests(path, head, names=manifest.shares(head["files"], world=world)[rank])
        mine = None
    except Unverified as err:
        mine = str(err)
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, mine)
    reason = next((o for o in outcomes if o is not None), None)
    if rank == 0:
        catalog.remember(path, reason=reason)
    if reason is not None:
        raise Unverified(reason)
    return Verified(Path(path), head)


def _layout_or_reason(path: Path) -> dict[str, Any] | str:
    try:
        return catalog.check_layout(path)
    except Unverified as err:
        catalog.remember(path, reason=str(err))
        return str(err)


def _from_rank0(fn: Callable[[], T]) -> T:
    """Collective over the world: rank 0 runs `fn`, every rank returns its result or raises
    its error (a ValueError keeps its type and message)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - the others must hear of any failure
            box[0] = ("value" if isinstance(err, ValueError) else "other", str(err))
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "ok":
        return value
    raise ValueError(value) if kind == "value" else RuntimeError(f"rank 0: {value}")


# -- saving ------------------------------------------------------------------------------------
def save(path: Path, *, parallel: ParallelState, train_state: dict[str, Any],
         rank_state: dict[str, Any], model_config: ModelConfig | None = None,
         keep: int = 2) -> Path:
    """Collective and synchronous: every rank writes its own shards into `path`
    (`ckpt_writer`; the trainer's saves go through a `Checkpointer`, asynchronous by default).
    `train_state` holds "step" and the layout (dp/tp/pp/zero); `model_config` is recorded so
    another model shape is refused on load. `keep` > 0 verified checkpoints are kept (see
    `ckpt_catalog.prune`), 0 keeps all."""
    writer = Checkpointer(parallel.mesh, asynchronous=False, retention=Retention(keep=keep))
    writer.save(Path(path), parallel=parallel, train_state=train_state, rank_state=rank_state,
                model_config=model_config)
    return Path(path)


def _dcp_load(chunks: list[Chunk], path: Path) -> None:
    """Read into `chunks` (views of this rank's buffers) the overlapping ranges of whatever
    chunks the checkpoint holds; its index is read by `safe_dcp`, no object is unpickled."""
    try:
        dcp.load({}, storage_reader=safe_load.SafeReader(str(path)),
                 planner=ChunkLoadPlanner(chunks))
    except CheckpointException as err:  # raised alike on every rank (DCP agrees on failures)
        raise Refused(f"checkpoint {path} verifies but cannot be loaded here "
                         f"({writer.reason(err)}): {_FIX}") from None


# -- loading -----------------------------------------------------------------------------------
def load(checkpoint: Verified | Path, *, parallel: ParallelState,
         model_config: ModelConfig | None = None,
         accept: Callable[[Verified, dict[str, Any]], None] | None = None
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: load the engine's weights and optimizer state of `parallel` in place (this
    rank's dp shard of its tp slice, per the shard spec); returns (train_state, this rank's
    rank_state). A Path is verified first (`agreed_check`); nothing in the
    directory is read before that. With `model_config`, a checkpoint of another model shape
    is refused (ValueError) before any tensor is read; another dp/tp/pp/zero layout is
    resharded. `accept(verified, train_state)` may refuse the checkpoint's recorded state
    (raising; every rank reads the same file, so all raise alike) before any tensor is read.
    A rank that has no file of its own (the world grew) takes rank 0's RNG state.
    """
    verified = checkpoint if isinstance(checkpoint, Verified) else agreed_verified(checkpoint)
    path = verified.path
    if model_config is not None:
        _refuse_other_shape(verified, model=model_config)
    train_state = json.loads((path / "train_state.json").read_text())
    if accept is not None:
        accept(verified, train_state)
    rank_state = _agreed(path, read=lambda: _read_rank_state(path))
    engine = parallel.engine
    step = torch.zeros(())
    chunks = unit_chunks(parallel, optimizer_flats(parallel), copies=True)
    chunks.append(Chunk(state_path("step", engine.units[0].names[0]), (), (), step))
    _dcp_load(chunks, path)
    refresh_from_masters(engine, steps=int(step))
    torch.set_rng_state(rank_state["rng"]["torch"])
    return train_state, rank_state


def _refuse_other_shape(verified: Verified, *, model: ModelConfig) -> None:
    diff = manifest.shape_mismatch(verified.manifest, model=model)
    if diff:
        raise ValueError(
            f"checkpoint {verified.path} holds another model shape ({'; '.join(diff)}): set "
            "the model back to the checkpoint's, start over with train.resume=never, or use "
            "another run directory (hydra.run.dir=...). A different parallel.dp/tp/pp/zero "
            "needs nothing: checkpoints are resharded on load")


def _read_rank_state(path: Path) -> dict[str, Any]:
    """This rank's RNG/scaler file (weights_only: plain data and tensors, never code), after
    checking DCP's index the same way (`safe_dcp`) so that both fail here, agreed."""
    safe_load.read_metadata(path)
    own = path / f"rank_{dist.get_rank():05d}.pt"  # a listed one only: never a stray file
    return torch.load(own if own.name in manifest.listed(path) else path / "rank_00000.pt",
                      weights_only=True)


def _agreed(path: Path, *, read: Callable[[], T]) -> T:
    """Collective: `read()` on every rank; if it failed on any, every rank raises one
    ValueError naming the first failing rank (no rank is left waiting in a collective)."""
    try:
        value, error = read(), None
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        value, error = None, f"{type(err).__name__}: {_reason(err)}"
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    for rank, err in enumerate(errors):
        if err is not None:
            raise Refused(
                f"checkpoint {path} verifies but rank {rank} refused to load it ({err}): "
                "hpctrain's saves never hold such content, so its files were changed along "
                f"with {manifest.MANIFEST} (or written by an incompatible torch); {_FIX}")
    return value


def _reason(err: Exception) -> str:
    """The gist of a loader's error: torch's weights_only message is a page that ends in the
    actual refusal (and advises weights_only=False, which is exactly what must not happen)."""
    text = str(err)
    refused = re.search(r"Unsupported (global: GLOBAL \S+|operand \S+)", text)
    if refused:
        return refused[0]
    if text.startswith("Weights only load failed"):  # the rest is advice to load unsafely
        return "torch.load(weights_only=True) refused an object that is not plain data"
    return (text.splitlines() or [""])[0][:200]

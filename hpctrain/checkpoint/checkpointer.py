"""The run's checkpoint saves: at most one in flight, written in the background or not.

`Checkpointer.save` is collective (every rank at the same step) and returns after the part
that must block training: waiting for the previous save, cutting this rank's chunks and —
asynchronous — copying them into host staging buffers. The rest (`ckpt_writer.write`) runs on
a thread over the mesh's `io` group. `poll` and `wait` hand its outcome to the training thread
at a step every rank agrees on (see `ckpt_writer`). `records` holds one record per save: its
`step`, `ckpt_block_s` (the training thread's time in `save`) and, once written,
`ckpt_background_s`, `ckpt_bytes` (this rank's) and `ckpt_mb_per_s`; `finished()` hands
each completed record out once (for the metrics).
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.checkpoint.shards import Chunk, optimizer_flats, step_chunks, unit_chunks
from hpctrain.checkpoint.writer import Job, Request, Retention, partial_of, write
from hpctrain.distributed.device import synchronize
from hpctrain.distributed.mesh import Mesh
from hpctrain.parallel.state import ParallelState


class Checkpointer:
    def __init__(self, mesh: Mesh, *, asynchronous: bool, retention: Retention | None = None):
        self.mesh, self.asynchronous = mesh, asynchronous
        self.retention = retention if retention is not None else Retention()
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="hpctrain-ckpt")
                      if asynchronous else None)
        self._job: Job | None = None
        self._staged: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.last_step: int | None = None  # of the newest save, in flight or sealed
        self.records: list[dict[str, float]] = []
        self._reported = 0

    @property
    def in_flight(self) -> bool:
        return self._job is not None

    # -- saving ---------------------------------------------------------------------------
    def save(self, path: Path, *, parallel: ParallelState, train_state: dict[str, Any],
             rank_state: dict[str, Any], model_config=None) -> None:
        """Collective. Start (asynchronous) or do the save of this rank's state into `path`.
        Raises `CheckpointWriteError` if this or the previous save failed."""
        start = time.perf_counter()
        self.wait()
        self._fresh_partial(path)
        chunks = unit_chunks(parallel, optimizer_flats(parallel))
        chunks += step_chunks(parallel, torch.tensor(float(parallel.engine.optimizer.steps)))
        if self.asynchronous:
            chunks = self._stage(chunks)
        request = Request(Path(path), chunks, {**rank_state, "rng": _rng_state()},
                          dict(train_state), model_config, self.retention)
        self.last_step = int(train_state["step"])
        record: dict[str, float] = {"step": self.last_step, "ckpt_started_at": time.time()}
        self.records.append(record)
        if not self.asynchronous:
            record.update(write(request, group=self.mesh.io))
            record["ckpt_block_s"] = time.perf_counter() - start
            return
        self._job = Job(Path(path), self.last_step,
                        self._pool.submit(write, request, group=self.mesh.io))
        record["ckpt_block_s"] = time.perf_counter() - start

    def _fresh_partial(self, path: Path) -> None:
        """A killed save's leftovers must not end up in this one's manifest."""
        partial = partial_of(Path(path))
        if self.mesh.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier(group=self.mesh.world)

    def _stage(self, chunks: list[Chunk]) -> list[Chunk]:
        """Host copies of `chunks` (one buffer per chunk, kept for the next save; pinned when
        the chunk is on an accelerator, so the copy overlaps)."""
        out = []
        for chunk in chunks:
            key, data = (chunk.key, chunk.offsets), chunk.data
            buf = self._staged.get(key)
            if buf is None or buf.shape != data.shape or buf.dtype != data.dtype:
                buf = torch.empty(data.shape, dtype=data.dtype,
                                  pin_memory=data.device.type != "cpu")
                self._staged[key] = buf
            buf.copy_(data, non_blocking=True)
            out.append(Chunk(chunk.path, chunk.size, chunk.offsets, buf))
        synchronize(self.mesh.device)
        return out

    def staged_bytes(self) -> int:
        return sum(t.nbytes for t in self._staged.values())

    # -- finishing ------------------------------------------------------------------------
    def poll(self) -> None:
        """Collective, every step while a save is in flight: finish it once every rank's write
        has ended (raising its `CheckpointWriteError` then, on every rank)."""
        if self._job is None:
            return
        flag = torch.tensor([1.0 if self._job.future.done() else 0.0], device=self.mesh.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.mesh.world)
        if flag.item() == 1.0:
            self._finish()

    def wait(self) -> None:
        """Collective: block until the save in flight (if any) is sealed. Raises its
        `CheckpointWriteError` on every rank."""
        if self._job is not None:
            self._finish()

    def _finish(self) -> None:
        job, self._job = self._job, None
        record = next(r for r in reversed(self.records) if r["step"] == job.step)
        record.update(job.future.result())

    def finished(self) -> list[dict[str, float]]:
        """The records completed since the last call (each handed out once); saves complete
        in order and only the newest can be in flight."""
        end = len(self.records) - (1 if self._job is not None else 0)
        done, self._reported = self.records[self._reported:end], max(self._reported, end)
        return done

    def started_at(self, step: int) -> dict[str, float]:
        """{"ckpt_block_s"} of a save started at `step` ({} when none was)."""
        last = self.records[-1] if self.records else None
        return {"ckpt_block_s": last["ckpt_block_s"]} if last and last["step"] == step else {}

    def summary(self) -> dict[str, float]:
        """summary.json's view of the run's saves: how many, the training time they blocked
        and the background time in all, the last save's bytes (this rank's), the median MB/s."""
        done = [r for r in self.records if "ckpt_background_s" in r]
        if not done:
            return {"ckpt_saves": 0}
        rates = sorted(r["ckpt_mb_per_s"] for r in done)
        return {"ckpt_saves": len(done), "ckpt_block_s": sum(r["ckpt_block_s"] for r in done),
                "ckpt_background_s": sum(r["ckpt_background_s"] for r in done),
                "ckpt_bytes": done[-1]["ckpt_bytes"], "ckpt_mb_per_s": rates[len(rates) // 2]}

    def close(self) -> None:
        """Wait for the save in flight (collective), then stop the writing thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def save_metrics(saves: list[dict[str, float]]) -> dict[str, float]:
    """metrics.jsonl's keys for the newest of `saves` (records `finished` handed out): its
    background half, when it started and was sealed, and its step."""
    if not saves:
        return {}
    keys = ("ckpt_background_s", "ckpt_bytes", "ckpt_mb_per_s", "ckpt_started_at",
            "ckpt_sealed_at")
    return {**{k: saves[-1][k] for k in keys}, "ckpt_saved_step": saves[-1]["step"]}


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state()}

"""`train.export_every`: each kept checkpoint at a multiple of it, exported while training goes
on as a Hugging Face directory `<run_dir>/hf/step_XXXXXXXX` (task=export's `export_hf`, in
export.* defaults: bf16, shards of at most 5 GB, the run's tokenizer files).

Only the logging rank exports, on one background thread, once the save is sealed (every rank
wrote its shards and the manifest is in place: `Checkpointer.finished`); it reads the
checkpoint from storage like task=export, so it holds the full model in host memory once,
beside training. Validation makes export_every a multiple of train.keep_every, so retention
never deletes a checkpoint being read. An export that fails is logged with the command that
redoes it; training goes on (the checkpoint is the state, the export a copy of it).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpctrain.checkpoint.hf_export import export_hf
from hpctrain.checkpoint.save_load import checkpoint_dir
from hpctrain.config.export import ExportConfig

log = logging.getLogger(__name__)


class Exporter:
    """Exports of the run's sealed saves whose step is a multiple of `every` (0: none)."""

    def __init__(self, run_dir: Path, *, every: int):
        self.run_dir, self.every = Path(run_dir), every
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hpctrain-export") if every else None
        self._jobs: list[tuple[int, Path, Future]] = []

    def sealed(self, saves: list[dict[str, float]]) -> None:
        """Start the export of each of `saves` (records of sealed saves) at a multiple of
        `every`."""
        for record in saves:
            step = int(record["step"])
            if self._pool is None or step % self.every:
                continue
            source = checkpoint_dir(self.run_dir, step)
            out = self.run_dir / "hf" / source.name
            self._jobs.append((step, out, self._pool.submit(self._export, source, out)))

    def _export(self, source: Path, out: Path) -> float:
        start = time.perf_counter()
        export_hf(ExportConfig(from_=str(source), out=str(out)), run_dir=self.run_dir)
        return time.perf_counter() - start

    def close(self) -> dict[str, Any]:
        """Wait for the exports started; summary.json's `exports`: one record per export."""
        done = []
        for step, out, future in self._jobs:
            try:
                seconds = future.result()
                done.append({"step": step, "out": str(out), "export_s": round(seconds, 3)})
                log.info("exported step %d as a Hugging Face directory: %s (%.1f s)", step,
                         out, seconds)
            except Exception as err:  # a copy failed; the checkpoint stands
                done.append({"step": step, "out": str(out), "error": str(err)})
                log.warning("export of step %d to %s failed (%s); the checkpoint is intact: "
                            "python -m hpctrain task=export export.from=%s export.out=%s",
                            step, out, err, checkpoint_dir(self.run_dir, step), out)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._jobs = []
        return {"exports": done} if self.every else {}

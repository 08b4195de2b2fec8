"""Out of memory: what the rank held, what the planner predicted, and the fix, in one message.

On CUDA every rank records the allocator's history from its start (`record`, torch's
`_record_memory_history`: a ring of recent allocations with their stacks); when an allocation
fails, `stop` writes, into `<run_dir>/oom/`:

- `rank_<r>_snapshot.pickle`: torch's memory snapshot with that history (CUDA only; open it at
  https://pytorch.org/memory_viz);
- `rank_<r>_predicted.json`: the planner's breakdown for this run (`plan.predict.predicted_peak`:
  model states, activations, buffers, total) next to the measured peaks;

and returns the `RunStopped` (exit `EXIT_OOM`) whose message names the step, the rank, the
measured and predicted peaks and the fix. The rank's peers then lose it and report it as
raised (no requeue on Slurm: the same step would run out again).
"""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path

import torch

from hpctrain.config.schema import Config
from hpctrain.errors import RunStopped

log = logging.getLogger(__name__)

EXIT_OOM = 4  # 2: a refused configuration, 3: a hang or a non-finite stop
HISTORY_ENTRIES = 100_000
GIB = 2**30


def record(device: torch.device) -> None:
    """Start the allocator's history on CUDA (a no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)


def _measured(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"max_allocated": torch.cuda.max_memory_allocated(device),
                "max_reserved": torch.cuda.max_memory_reserved(device),
                "capacity": torch.cuda.get_device_properties(device).total_memory}
    return {"max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def stop(cfg: Config, err: BaseException, *, rank: int, step: int | None,
         device: torch.device) -> RunStopped:
    """Write the snapshot and the prediction (module doc); the message as a RunStopped."""
    folder = Path(cfg.run_dir) / "oom"
    folder.mkdir(parents=True, exist_ok=True)
    measured = _measured(device)
    first = str(err).splitlines()[0] if str(err) else repr(err)
    snapshot = None
    if device.type == "cuda":
        snapshot = folder / f"rank_{rank}_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(snapshot))
    try:
        from hpctrain.plan.predict import predicted_peak

        predicted: dict[str, float] | None = predicted_peak(cfg)
    except (ValueError, RuntimeError) as why:  # a layout the planner does not model
        log.warning("no prediction for this layout: %s", why)
        predicted = None
    (folder / f"rank_{rank}_predicted.json").write_text(json.dumps(
        {"step": step, "rank": rank, "error": first,
         "measured_bytes": measured, "predicted_bytes": predicted}, indent=1))
    peak = measured.get("max_allocated", measured.get("max_rss", 0.0))
    what = "allocated" if "max_allocated" in measured else "resident (max RSS)"
    said = (f"the planner predicted {predicted['total'] / GIB:.3g} GiB a rank (states "
            f"{predicted['states'] / GIB:.3g}, activations {predicted['activations'] / GIB:.3g})"
            if predicted else "the planner has no prediction for this layout")
    files = f"{snapshot.name} (https://pytorch.org/memory_viz) and " if snapshot else ""
    return RunStopped(
        f"out of memory in step {step} on rank {rank}: {first}; "
        f"measured peak {peak / GIB:.3g} GiB {what}, {said}. Memory history: {files}"
        f"rank_{rank}_predicted.json in {folder}. Fix: lower train.micro_batch_size, set "
        "train.activation_checkpointing=selective or full, raise parallel.zero (or "
        "parallel.offload=cpu), or run parallel=auto, which chooses a layout that fits "
        "(python -m hpctrain task=plan shows each one's memory)", exit_code=EXIT_OOM)

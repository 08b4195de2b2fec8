"""Where a run's processes keep their files inside the run directory: one place for the paths.

Working files that a healthy run needs and nobody reads (each rank's heartbeat, the local
launcher's rendezvous store) live in `<run_dir>/.hpctrain/`; `<run_dir>/hang/` is created only
when a rank suspects or reports a hang (stacks, flight recorder, report.txt).
"""

from __future__ import annotations

import re
from pathlib import Path

WORK_DIR = ".hpctrain"
CHECKPOINT = re.compile(r"^step_(\d{8})$")  # a finished save (a `.partial` one is being written)


def work_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / WORK_DIR


def heartbeat_dir(run_dir: Path | str) -> Path:
    """`rank_N.json` of every rank, written by its watchdog (hpctrain.distributed.watchdog)."""
    return work_dir(run_dir) / "heartbeat"


def hang_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "hang"


def checkpoints(run_dir: Path | str) -> list[Path]:
    """Finished (renamed, not `.partial`) checkpoint directories, newest first; whether they
    verify is `train.ckpt_catalog`'s question."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if CHECKPOINT.match(p.name)), reverse=True)

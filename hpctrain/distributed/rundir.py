"""Where a run's processes keep their files inside the run directory: one place for the paths.

Working files that a healthy run needs and nobody reads (each rank's heartbeat, the local
launcher's rendezvous store) live in `<run_dir>/.hpctrain/`; `<run_dir>/hang/` is created only
when a rank suspects or reports a hang (stacks, flight recorder, report.txt).
"""

from __future__ import annotations

from pathlib import Path

WORK_DIR = ".hpctrain"


def work_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / WORK_DIR


def heartbeat_dir(run_dir: Path | str) -> Path:
    """`rank_N.json` of every rank, written by its watchdog (hpctrain.distributed.watchdog)."""
    return work_dir(run_dir) / "heartbeat"


def hang_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "hang"

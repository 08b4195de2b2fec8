"""Progress display on the logging rank: a rich bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

log = logging.getLogger("hpctrain")


def _fmt(metrics: dict[str, Any]) -> str:
    parts = []
    for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s"):
        v = metrics.get(key)
        if v is None:
            continue
        parts.append(f"{key}={v:.4g}" if isinstance(v, float) else f"{key}={v}")
    return " ".join(parts)


class Progress:
    """Implements the logger protocol; `advance` is called every step."""

    def __init__(self, mode: str, *, total: int, start: int):
        self.use_rich = mode == "rich" or (mode == "auto" and sys.stdout.isatty())
        self.total = total
        self._bar = None
        if self.use_rich:
            self._bar = RichProgress(TextColumn("[bold]train"), BarColumn(),
                                     MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"))
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, info=_fmt(metrics))
        else:
            log.info("step %d/%d %s", step, self.total, _fmt(metrics))

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

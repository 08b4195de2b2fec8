"""Progress display on the logging rank, on stderr (results go to stdout): a one-line bar on a
terminal that fits 80 columns (step, bar, loss, tokens/s, ETA), plain log lines otherwise, each
with the ETA (every train.log_every steps, and at evaluations)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
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


def _short(metrics: dict[str, Any]) -> str:
    """The bar's few numbers: 'loss 2.041 eval 2.1 3.2k tok/s' (≤ 32 characters)."""
    parts = [f"loss {metrics['loss']:.4g}"] if metrics.get("loss") is not None else []
    if metrics.get("eval_loss") is not None:
        parts.append(f"eval {metrics['eval_loss']:.4g}")
    if metrics.get("tokens_per_s") is not None:
        parts.append(f"{_si(metrics['tokens_per_s'])} tok/s")
    return " ".join(parts)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def eta(seconds: float | None) -> str:
    """h:mm:ss, or '?' before the first step's time is known."""
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Implements the logger protocol; `advance(step)` is called after every step (0-based)."""

    def __init__(self, mode: str, *, total: int, start: int):
        self.use_rich = mode == "rich" or (mode == "auto" and sys.stderr.isatty())
        self.total, self.start, self.done = total, start, start
        self.t0 = time.monotonic()
        self._bar, self._moved = None, []
        if self.use_rich:
            self._bar = RichProgress(TextColumn("step {task.completed}/{task.total}"),
                                     BarColumn(bar_width=12), TextColumn("{task.fields[info]}"),
                                     TextColumn("ETA"), TimeRemainingColumn(),
                                     console=Console(stderr=True))
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            before = sys.stderr
            self._bar.start()  # on a terminal sys.stderr is now rich's proxy, above the bar
            self._moved = _move_log_streams(before, sys.stderr)

    def eta_s(self) -> float | None:
        """Seconds left at the mean step time of this run so far (None before a step)."""
        ran = self.done - self.start
        if ran <= 0:
            return None
        return (time.monotonic() - self.t0) / ran * (self.total - self.done)

    def advance(self, step: int) -> None:
        self.done = step + 1
        if self._bar is not None:
            self._bar.update(self._task, completed=step + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(self._task, info=_short(metrics))
        else:
            log.info("step %d/%d %s eta=%s", step, self.total, _fmt(metrics), eta(self.eta_s()))

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        if self._bar is not None:
            for handler, stream in self._moved:
                handler.setStream(stream)
            self._bar.stop()


def _move_log_streams(old, new) -> list[tuple[logging.StreamHandler, Any]]:
    """Point the log handlers writing to `old` (stderr before the bar) at `new`, so log lines
    print above the bar instead of into it; returns (handler, old stream) to restore."""
    if new is old:
        return []
    moved = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(new)
            moved.append((handler, old))
    return moved

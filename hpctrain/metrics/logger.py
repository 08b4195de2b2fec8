"""The logger protocol and its JSONL implementation.

JSONL is always written by the logging rank: tests, benchmarks and the sweep table read it.
Other sinks (W&B, the progress display) implement the same three methods.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from hpctrain.metrics.redact import Secrets


class MetricsLogger(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...
    def summary(self, values: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write null for non-finite floats."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlLogger:
    """`metrics.jsonl` (one object per logged step, appended so resumes continue the file)
    and `summary.json`."""

    def __init__(self, run_dir: Path, *, start_step: int = 0, secrets: Secrets | None = None):
        self.secrets = secrets or Secrets()
        self.path = run_dir / "metrics.jsonl"
        self.summary_path = run_dir / "summary.json"
        self._truncate_after(start_step)
        self._f = self.path.open("a")

    def _truncate_after(self, step: int) -> None:
        """On resume after k completed steps, drop records of later steps (written after the
        checkpoint by the interrupted run)."""
        if not self.path.exists():
            return
        kept = [ln for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", -1) <= step]
        self.path.write_text("".join(ln + "\n" for ln in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one record: the step, its metrics and `time` (Unix seconds when logged)."""
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()},
                  "time": round(time.time(), 3)}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def summary(self, values: dict[str, Any]) -> None:
        clean = self.secrets.data({k: _clean(v) for k, v in values.items()})
        self.summary_path.write_text(json.dumps(clean, indent=2) + "\n")

    def close(self) -> None:
        self._f.close()


class MultiLogger:
    def __init__(self, *sinks: MetricsLogger):
        self.sinks = [s for s in sinks if s is not None]

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def summary(self, values: dict[str, Any]) -> None:
        for s in self.sinks:
            s.summary(values)

    def alert(self, title: str, text: str) -> None:
        """To the sinks that alert a person (W&B); the others have the metrics already."""
        for s in self.sinks:
            if hasattr(s, "alert"):
                s.alert(title, text)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]

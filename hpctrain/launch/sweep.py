"""The end of a sweep (`python -m hpctrain -m ...`): one table of every point's final numbers.

`SweepSummary` is a Hydra callback registered in conf/config.yaml. Before the launcher starts
(`on_multirun_start`, in the submitting process) it validates every sweep point and prepares
the data once, so Slurm jobs only read the token cache. When the sweep ends it reads each
point's result file (`sweep_results`: train, simulate, plan or bench) and writes `sweep_summary.md`
and `sweep_summary.json` into the sweep dir, and logs the table. Hydra raises on the first
failed point before `on_multirun_end` runs, so the table is also written at interpreter exit
when the sweep did not end normally: a failed point is listed with its log paths, beside the
others.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import traceback
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hpctrain.data.checks import check_prepared
from hpctrain.data.prepare import prepare
from hpctrain.launch.record import RECORD_DIR, write_record
from hpctrain.launch.sweep_check import parsed_points, sweep_points
from hpctrain.launch.sweep_results import read_result
from hpctrain.metrics.redact import Secrets
from hpctrain.tasks import reads_data

log = logging.getLogger(__name__)
COLUMNS = ("final_loss", "final_eval_loss", "completed_steps", "tokens_per_s")


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    return [str(o) for o in OmegaConf.load(path)]


def _logs(sweep_dir: Path, run_dir: Path, num: int) -> list[str]:
    """Where to look when a point failed: submitit's task logs and Hydra's job log."""
    found = sorted(sweep_dir.glob(f".submitit/*_{num}/*_{num}_*_log.*"))
    found += sorted(run_dir.glob("*.log"))
    return [str(p) for p in found]


def _error_line(logs: list[str]) -> str | None:
    """The last line that looks like a Python exception in the logs, if any."""
    pattern = re.compile(r"^\w+(\.\w+)*(Error|Exception|Interrupt)\b.*")
    last = None
    for path in logs:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if pattern.match(line.strip()):
                last = line.strip()
    return last


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per point: its number, overrides, status and final metrics (or its logs)."""
    sweep_dir = Path(sweep_dir)
    nums = {int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}
    nums |= {int(m.group(1)) for p in sweep_dir.glob(".submitit/*")
             if (m := re.fullmatch(r"\d+_(\d+)", p.name))}
    rows = []
    for num in sorted(nums):
        run_dir = sweep_dir / str(num)
        row: dict[str, Any] = {"point": num, "overrides": _overrides(run_dir),
                               "run_dir": str(run_dir)}
        error_path, result = run_dir / "error.txt", read_result(run_dir)
        if error_path.exists():
            row["status"] = "failed"
            row["logs"] = [str(error_path), *_logs(sweep_dir, run_dir, num)]
            row["error"] = error_path.read_text().strip().splitlines()[0]
        elif result is not None:
            row["task"], row["status"], numbers = result
            row.update(numbers) if row["task"] == "train" else row.update(result=numbers)
        else:
            row["status"] = "failed"
            row["logs"] = _logs(sweep_dir, run_dir, num)
            row["error"] = _error_line(row["logs"])
        rows.append(row)
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table shows the overrides that differ between points; shared ones go above it."""
    shared = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    others = any("result" in r for r in rows)  # points of tasks other than train
    columns = COLUMNS if any(r.get("task") == "train" for r in rows) or not others else ()
    lines = [f"shared overrides: {' '.join(o for o in rows[0]['overrides'] if o in shared)}\n"
             ] if shared else []
    head = ["point", "status", "overrides", *columns, *(["result"] if others else [])]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        own = [o for o in r["overrides"] if o not in shared]
        cells = [str(r["point"]), r["status"], " ".join(own), *(_fmt(r.get(k)) for k in columns)]
        if others:
            cells.append(" ".join(f"{k}={_fmt(v)}" for k, v in (r.get("result") or {}).items()))
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        lines.append(f"\npoint {r['point']} {r['status']}: {r.get('error') or ''}")
        lines += [f"  log: {p}" for p in r.get("logs", [])] or [f"  run dir: {r['run_dir']}"]
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: str | Path) -> list[dict[str, Any]]:
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    table = markdown(rows)
    (sweep_dir / "sweep_summary.md").write_text(table)
    (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    log.info("sweep summary (%s):\n%s", sweep_dir / "sweep_summary.md", table)
    return rows


class SweepSummary(Callback):
    def __init__(self) -> None:
        self.sweep_dir: str | None = None
        self.written = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = str(config.hydra.sweep.dir)
        Path(self.sweep_dir).mkdir(parents=True, exist_ok=True)
        try:
            _prepare_base(config, self.sweep_dir)
        except ValueError as err:
            # Hydra turns a callback's Exception into a warning and launches anyway; a config
            # mistake must stop the sweep before anything reaches the queue.
            log.error("%s", err)
            raise SystemExit(2) from err
        atexit.register(self._write_if_pending)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._write_if_pending()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """In the job: a failed point leaves `error.txt` (exception and traceback) in its run
        dir, since Hydra hands the exception to the submitting process, not to the logs. A
        single run writes nothing here: its error is on the terminal, and its directory may be
        another live run's."""
        if job_return.status != JobStatus.FAILED or HydraConfig.get().mode != RunMode.MULTIRUN:
            return
        err = job_return._return_value
        text = "".join(traceback.format_exception(err)) if isinstance(err, BaseException) else ""
        hydra_cfg = HydraConfig.get()
        run_dir = Path(hydra_cfg.runtime.output_dir)
        (run_dir / "error.txt").write_text(f"{type(err).__name__}: {err}\n\n{text}")
        if not (run_dir / RECORD_DIR / "overrides.yaml").exists():  # failed before the lock
            secrets = Secrets.of(config.get("cluster", {}).get("env") or {},
                                 config.get("logger", {}).get("redact") or ())
            write_record(run_dir, {"overrides.yaml": yaml.safe_dump(
                secrets.data(list(hydra_cfg.overrides.task)))})

    def _write_if_pending(self) -> None:
        if self.sweep_dir is None or self.written:
            return
        self.written = True
        try:
            write_summary(self.sweep_dir)
        except Exception:  # never turn a sweep's own error into a summary error
            log.exception("could not write the sweep summary of %s", self.sweep_dir)


def _prepare_base(config: DictConfig, sweep_dir: str) -> None:
    """Validate every point before any job starts (`sweep_check`), then prepare the data of
    each distinct data config once, so jobs only read the token cache, and check that every
    point's batches fit its data (one ValueError naming each point that does not). A Slurm
    task=prepare point is left to its job."""

    points = parsed_points(config, run_dir=sweep_dir)
    overrides = sweep_points(list(config.hydra.overrides.task))
    # task=prepare on Slurm is the job's own work (its tasks share it): not done here
    here = [reads_data(p) and not (p.task == "prepare" and p.cluster.launcher == "slurm")
            for p in points]
    prepared = {p.data: prepare(p.data) for p, now in zip(points, here, strict=True) if now}
    errors = []
    for i, point in enumerate(points):
        try:
            if here[i]:
                check_prepared(point, prepared[point.data])
        except ValueError as err:
            errors.append(f"point {i} ({' '.join(overrides[i]) or 'no overrides'}): {err}")
    if errors:
        raise ValueError(f"{len(errors)} of {len(points)} sweep point(s) have less data than a "
                         "batch; nothing was launched:\n" + "\n".join(errors))
    for i, point in enumerate(points):
        if point.task == "train" and point.cluster.check_before_submit:
            from hpctrain.tasks.dryrun.run import check_before_submit  # torch, the model: seconds

            check_before_submit(point, run_dir=Path(sweep_dir) / f"dryrun.{i}")

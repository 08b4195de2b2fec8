"""What a run leaves behind on the logging rank: loggers, the final summary, the plot; and the
profiler's traces (train.profile) on every rank."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from hpctrain.config.schema import Config, TrainConfig
from hpctrain.metrics.logger import JsonlLogger, MultiLogger
from hpctrain.metrics.progress import Progress
from hpctrain.metrics.redact import Secrets
from hpctrain.metrics.throughput import parameter_counts
from hpctrain.metrics.wandb_logger import WandbLogger


class Prediction(Protocol):
    """What the planner predicted for the run (hpctrain.plan.predict.RunPrediction, built by
    the task above train): logged once with the first record, compared in the summary."""

    def once(self) -> dict[str, Any]: ...

    def summary(self, summary: dict[str, Any], ledger: dict[str, int]) -> dict[str, Any]: ...


class NoPrediction:
    """A run without a prediction (benchmarks, tests that build the Trainer themselves)."""

    def once(self) -> dict[str, Any]:
        return {}

    def summary(self, summary: dict[str, Any], ledger: dict[str, int]) -> dict[str, Any]:
        return {}


def never_stop() -> bool:
    """The stop check of a Trainer run outside a launcher: no rank can be signalled."""
    return False


def make_loggers(cfg: Config, *, run_dir: Path, start_step: int) -> tuple[MultiLogger, Progress]:
    progress = Progress(cfg.logger.progress, total=cfg.train.steps, start=start_step)
    secrets = Secrets.of(cfg.cluster.env, cfg.logger.redact)
    wandb = None
    if cfg.logger.wandb != "disabled":
        wandb = WandbLogger(cfg.logger, run_dir=run_dir, config=dataclasses.asdict(cfg),
                            secrets=secrets)
    jsonl = JsonlLogger(run_dir, start_step=start_step, secrets=secrets)
    return MultiLogger(jsonl, wandb, progress), progress


def summarize(history: list[dict[str, Any]], *, cfg: Config, run_dir: Path,
              extra: dict[str, Any], evicted: int = 0) -> dict[str, Any]:
    """Final numbers of a run from its recent step records (`history`, after `evicted` older
    ones were dropped). Throughput is the median over those steps, leaving out the run's first
    two (they pay for allocator warm-up and lazy initialisation)."""
    warmup = max(0, 2 - evicted)
    steady = history[warmup:] or history
    tps = statistics.median(h["tokens_per_s"] for h in steady) if steady else None
    mfus = [h["mfu"] for h in steady if h.get("mfu") is not None]
    last = history[-1] if history else {}
    return {
        "steps": cfg.train.steps,
        "final_loss": last.get("loss"),
        "final_eval_loss": extra.pop("final_eval_loss", None),
        "tokens_per_s": tps,
        "mfu": statistics.median(mfus) if mfus else None,
        # FP8 runs keep MFU's bf16 denominator, so it compares with peers' numbers
        **({"mfu_against": "dense bf16 peak (FP8 GEMMs too)"} if cfg.train.fp8 else {}),
        "step_time_s": statistics.median(h["step_time_s"] for h in steady) if steady else None,
        "run_dir": str(run_dir),
        "metrics": str(run_dir / "metrics.jsonl"),
        **parameter_counts(cfg.model),  # total, and active per token for experts
        **extra,
    }


@contextlib.contextmanager
def step_profiler(t: TrainConfig, *, run_dir: Path, rank: int, device: torch.device):
    """train.profile: torch's profiler over train.profile_steps steps (after 1 wait and 1
    warm-up), its Chrome trace in <run>/profile/trace_rank<r>.json; else None."""
    if not t.profile:
        yield None
        return
    out = run_dir / "profile" / f"trace_rank{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities,
                 schedule=schedule(wait=1, warmup=1, active=t.profile_steps),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
        yield prof


def format_summary(summary: dict[str, Any]) -> str:
    """The run summary, set apart by rules, ending with where the outputs are."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    rule = "─" * 78
    lines = [rule, "run summary", *(f"  {k:<22} {fmt(v)}" for k, v in summary.items()
                                    if v is not None)]
    if "mfu" in summary and summary["mfu"] is None:
        lines.append(f"  {'mfu':<22} null (no dense bf16 peak known for this device)")
    if summary.get("run_dir"):
        plot = "training.png, " if summary.get("plot") else ""
        lines.append(f"outputs in {summary['run_dir']} (summary.json, metrics.jsonl, "
                     f"{plot}checkpoints/)")
    return "\n".join([*lines, rule])

"""A small picture of a run for people without W&B: loss and throughput over steps."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpctrain.metrics.logger import read_jsonl

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_run(metrics_path: Path, out_path: Path) -> Path | None:
    """Write loss (train and eval) and tokens/s against step to `out_path` (PNG)."""
    records = read_jsonl(metrics_path) if metrics_path.exists() else []
    fig = draw_run(records)
    if fig is None:
        return None
    fig.savefig(out_path, dpi=100)
    return out_path


def draw_run(records: list[dict]) -> Figure | None:
    """The figure of `plot_run` (None without a train loss); the throughput axis starts at 0,
    so a small wobble does not look like a collapse."""
    train = [r for r in records if r.get("loss") is not None]
    if not train:
        return None
    fig, (ax_loss, ax_tps) = _figure(1, 2, figsize=(10, 3.6))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-",
                     label="eval")
    ax_loss.set(xlabel="step", ylabel="loss", title="Loss")
    ax_loss.legend()
    tps = [r for r in train if r.get("tokens_per_s")]
    ax_tps.plot([r["step"] for r in tps], [r["tokens_per_s"] for r in tps], color="tab:green")
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="Throughput")
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _figure(*args, figsize: tuple[float, float], **kwargs):
    """(figure, axes) drawn with matplotlib's object API: no pyplot, so no process-wide
    backend or figure registry is touched (importing hpctrain has no side effects)."""
    from matplotlib.figure import Figure  # imported when drawing: ~0.5 s a process

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)

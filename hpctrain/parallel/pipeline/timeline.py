"""Draw a pipeline timeline (simulated or measured) as a PNG.

Input is plain data so the simulator and the runtime share it: per rank, a sequence of
(start, end, label, kind) with kind one of "F", "B", "W", "BW" (anything else is drawn grey).
Idle time stays white, so bubbles are visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

Box = tuple[float, float, str, str]  # (start, end, label, kind)
COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#c9a227", "BW": "#2f8f83"}
OTHER = "#9a9a9a"


def _draw_rank(ax, row: int, boxes: Sequence[Box], *, min_label_width: float) -> None:
    for start, end, label, kind in boxes:
        width = end - start
        ax.broken_barh(
            [(start, width)], (row - 0.4, 0.8),
            facecolors=COLORS.get(kind, OTHER), edgecolors="black", linewidth=0.3,
        )
        if label and width >= min_label_width:
            ax.text(start + width / 2, row, label, ha="center", va="center",
                    fontsize=6, color="white")


def draw_timeline(
    timeline_per_rank: Sequence[Sequence[Box]], path: str | Path, *, title: str
) -> Path:
    """Write one row per rank (rank 0 on top) to `path` as a PNG and return the path.

    A box's label (usually its microbatch) is printed when the box is at least 1/80 of the
    span wide, i.e. when it fits.
    """
    path = Path(path)
    ends = [end for boxes in timeline_per_rank for _, end, _, _ in boxes]
    span = max(ends, default=1.0) or 1.0
    n = len(timeline_per_rank)
    fig, ax = _figure(figsize=(12, 0.5 * n + 1.2))
    for rank, boxes in enumerate(timeline_per_rank):
        _draw_rank(ax, rank, boxes, min_label_width=span / 80)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)])
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("time")
    ax.set_title(title)
    from matplotlib.patches import Patch  # with the figure: only when drawing

    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=4,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    return path


def _figure(*args, figsize: tuple[float, float], **kwargs):
    """(figure, axes) drawn with matplotlib's object API: no pyplot, so no process-wide
    backend or figure registry is touched (importing hpctrain has no side effects)."""
    from matplotlib.figure import Figure  # imported when drawing: ~0.5 s a process

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)

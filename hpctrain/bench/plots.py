"""PNG figures for the bench report: busbw vs size, GEMM throughput vs size, p2p heat map."""

from __future__ import annotations

from pathlib import Path

from hpctrain.bench.summary import comm_rows, gemm_rows, p2p_matrix


def plot_comm(records: list[dict], out: Path) -> Path | None:
    """Bus bandwidth against message size, one line per (collective, group instance)."""
    rows = comm_rows(records)
    if not rows:
        return None
    fig, ax = _figure(figsize=(7, 4.2))
    for key in sorted({(r["collective"], r["group"], tuple(r["ranks"])) for r in rows}):
        line = [r for r in rows if (r["collective"], r["group"], tuple(r["ranks"])) == key]
        where = key[1] if key[1] == "world" else f"{key[1]} {list(key[2])}"
        label = f"{key[0]} ({where})"
        ax.plot([r["bytes"] for r in line], [r["busbw_GBps"] for r in line], "o-", ms=3,
                label=label)
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
           title="Collectives: bus bandwidth (slowest rank)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, out)


def plot_gemm(records: list[dict], out: Path) -> Path | None:
    """Median TFLOP/s of the square sweep against size, per precision; model shapes as points."""
    rows = gemm_rows(records)
    if not rows:
        return None
    fig, ax = _figure(figsize=(7, 4.2))
    for precision in sorted({r["precision"] for r in rows}):
        sq = [r for r in rows if r["precision"] == precision and r["kind"] == "square"]
        line = ax.plot([r["m"] for r in sq], [r["median_tflops"] for r in sq], "o-",
                       label=f"{precision} square")
        model = [r for r in rows if r["precision"] == precision and r["kind"] == "model"]
        ax.plot([(r["m"] * r["k"] * r["n"]) ** (1 / 3) for r in model],
                [r["median_tflops"] for r in model], "x", color=line[0].get_color(),
                label=f"{precision} model shapes")
        if sq and sq[0]["peak_tflops"]:
            ax.axhline(sq[0]["peak_tflops"], ls="--", color=line[0].get_color(), lw=0.8)
    ax.set(xscale="log", xlabel="size (cube root of M·K·N)", ylabel="TFLOP/s (median over ranks)",
           title="GEMM throughput")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, out)


def plot_p2p(records: list[dict], out: Path) -> Path | None:
    """Heat map of src → dst bandwidth: a cold row and column is a slow rank."""
    n, matrix = p2p_matrix(records)
    if n < 2:
        return None
    values = [[float("nan") if v is None else v for v in row] for row in matrix]
    fig, ax = _figure(figsize=(4 + 0.25 * n, 3.5 + 0.25 * n))
    im = ax.imshow(values, cmap="viridis")
    fig.colorbar(im, ax=ax, label="GB/s")
    if n <= 16:
        for i in range(n):
            for j in range(n):
                if matrix[i][j] is not None:
                    ax.text(j, i, f"{matrix[i][j]:.2g}", ha="center", va="center", fontsize=7,
                            color="w")
    ax.set(xlabel="dst rank", ylabel="src rank", title="p2p bandwidth")
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def make_plots(records: list[dict], run_dir: Path) -> dict[str, str]:
    made = {"comm": plot_comm(records, run_dir / "bench_comm_busbw.png"),
            "gemm": plot_gemm(records, run_dir / "bench_gemm.png"),
            "p2p": plot_p2p(records, run_dir / "bench_p2p_heatmap.png")}
    return {k: str(v) for k, v in made.items() if v is not None}


def _figure(*args, figsize: tuple[float, float], **kwargs):
    """(figure, axes) drawn with matplotlib's object API: no pyplot, so no process-wide
    backend or figure registry is touched (importing hpctrain has no side effects)."""
    from matplotlib.figure import Figure  # imported when drawing: ~0.5 s a process

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)

"""Write what the bench found: bench.json (every record), bench_report.md (tables, plots,
outliers, a ready-to-paste `--exclude=` line) and, if a W&B run is active, tables there."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from hpctrain.bench import summary as S
from hpctrain.bench.outliers import Finding, exclude_line, find_outliers, nodes_to_exclude
from hpctrain.bench.plots import make_plots
from hpctrain.config.bench import BenchConfig
from hpctrain.metrics.redact import Secrets
from hpctrain.metrics.wandb_logger import WandbLogger

log = logging.getLogger(__name__)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    """Markdown table of `rows`; cols are (key, header)."""
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return out + [""]


def _comm_md(records: list[dict]) -> list[str]:
    rows = [{**r, "time_us": r["time_s"] * 1e6} for r in S.comm_rows(records)]
    if not rows:
        return []
    md = ["## Collectives", "", "Slowest rank of each group; busbw per nccl-tests.", ""]
    md += _table(rows, [("collective", "collective"), ("group", "group"), ("ranks", "ranks"),
                        ("bytes", "bytes"), ("time_us", "time (µs)"), ("algbw_GBps", "algbw GB/s"),
                        ("busbw_GBps", "busbw GB/s"), ("correct", "correct")])
    md += [f"- {r['collective']} over {r['group']}: not supported ({r['error']})"
           for r in S.unsupported(records)]
    return md + ["![bus bandwidth](bench_comm_busbw.png)", ""]


def _p2p_md(records: list[dict]) -> list[str]:
    n, bw = S.p2p_matrix(records)
    if n < 2:
        return []
    _, lat = S.p2p_matrix(records, "latency_s")
    head = ["src \\ dst", *map(str, range(n))]
    md = ["## Point-to-point", "", "Bandwidth GB/s (row = sender):", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += [f"| {i} | " + " | ".join(_fmt(v) for v in bw[i]) + " |" for i in range(n)]
    md += ["", "Latency µs (half round trip):", "", "| " + " | ".join(head) + " |",
           "|" + "---|" * len(head)]
    md += [f"| {i} | " + " | ".join(_fmt(None if v is None else v * 1e6) for v in lat[i]) + " |"
           for i in range(n)]
    md += ["", "Per node pair:", ""]
    md += _table(S.node_pairs(records), [("src_node", "src node"), ("dst_node", "dst node"),
                                         ("links", "rank pairs"), ("median_bw_GBps", "median GB/s"),
                                         ("min_bw_GBps", "min GB/s")])
    return md + ["![p2p heat map](bench_p2p_heatmap.png)", ""]


def _gemm_md(records: list[dict]) -> list[str]:
    rows = S.gemm_rows(records)
    if not rows:
        return []
    md = ["## GEMM", "", "Median over ranks; peak from hpctrain.metrics.devices "
          "(– if unknown).", ""]
    md += _table(rows, [("precision", "precision"), ("kind", "kind"), ("shape", "shape"),
                        ("m", "M"), ("k", "K"), ("n", "N"), ("median_tflops", "TFLOP/s"),
                        ("min_tflops", "slowest TFLOP/s"), ("min_rank", "slowest rank"),
                        ("peak_tflops", "peak"), ("fraction_of_peak", "of peak")])
    return md + ["![GEMM throughput](bench_gemm.png)", ""]


def _train_md(records: list[dict]) -> list[str]:
    rows = [r for r in records if r.get("bench") == "train"]
    if not rows:
        return []
    return ["## Training", ""] + _table(rows, [
        ("model", "model"), ("world_size", "ranks"), ("precision", "precision"),
        ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("step_time_s", "step s"),
        ("peak_memory_bytes", "memory bytes"), ("metrics", "metrics")])


def _outliers_md(findings: list[Finding], exclude: str | None, fraction: float) -> list[str]:
    md = ["## Outliers", "", f"Below {fraction:g} × the median of their peers:", ""]
    md += [f"- {f.bench}: {f.name} on {', '.join(f.nodes) or 'n/a'} scores {f.score:.3f}"
           for f in findings] or ["- none"]
    if exclude:
        md += ["", "Resubmit without them:", "", "```", exclude,
               f"cluster.exclude={exclude.split('=', 1)[1]}", "```"]
    return md + [""]


def _meta(b: BenchConfig, cfg, records: list[dict]) -> dict[str, Any]:
    p = cfg.parallel
    return {"bench": b.name, "config": b.__dict__, "world_size": cfg.cluster.world_size,
            "layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp}, "backend": cfg.cluster.backend,
            "device": cfg.cluster.device, "torch": torch.__version__,
            "nodes": sorted({r["node"] for r in records}), "command": _command(),
            "time": datetime.datetime.now().isoformat(timespec="seconds")}


def _command() -> str:
    """How this process was started, as a person would retype it."""
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0] = "python -m hpctrain"
    return " ".join(argv)


def write_report(records: list[dict], *, b: BenchConfig, cfg, run_dir: Path) -> dict[str, Any]:
    """Write the three outputs into run_dir; returns a summary for the task's caller."""
    run_dir.mkdir(parents=True, exist_ok=True)
    findings = find_outliers(records, fraction=b.outlier_fraction)
    exclude = exclude_line(nodes_to_exclude(findings))
    meta = _meta(b, cfg, records)
    doc = {"meta": meta, "records": records, "outliers": [f.as_dict() for f in findings],
           "exclude": exclude}
    (run_dir / "bench.json").write_text(json.dumps(doc, indent=1, default=str))
    plots = make_plots(records, run_dir)
    md = [f"# Cluster benchmark: {b.name}", "",
          f"{meta['world_size']} ranks on {len(meta['nodes'])} node(s) "
          f"({', '.join(meta['nodes'])}); layout {meta['layout']}; torch {meta['torch']}; "
          f"{meta['time']}.", "", "Command: `" + meta["command"] + "`", ""]
    md += _comm_md(records) + _p2p_md(records) + _gemm_md(records) + _train_md(records)
    md += _outliers_md(findings, exclude, b.outlier_fraction)
    (run_dir / "bench_report.md").write_text("\n".join(md))
    _log_wandb(records, plots, cfg=cfg, run_dir=run_dir,
               summary={"outliers": len(findings), "exclude": exclude})
    log.info("bench report: %s (%d records, %d outlier(s))", run_dir / "bench_report.md",
             len(records), len(findings))
    return {"bench": b.name, "records": len(records), "json": str(run_dir / "bench.json"),
            "report": str(run_dir / "bench_report.md"), "plots": plots,
            "outliers": [f.as_dict() for f in findings], "exclude": exclude}


def _log_wandb(records: list[dict], plots, *, cfg, run_dir: Path, summary: dict) -> None:
    """On the report rank: one W&B table per benchmark, the plots as images, the outlier
    verdict in the summary. Uses the active run, else opens this run dir's run (online with a
    key, offline otherwise, the id kept in wandb_id.txt) unless logger.wandb=disabled."""
    if cfg.logger.wandb == "disabled":
        return
    import wandb  # optional and heavy (~1 s): only when W&B logging is on

    own = None
    if wandb.run is None:
        own = WandbLogger(cfg.logger, run_dir=run_dir, config=dataclasses.asdict(cfg),
                          secrets=Secrets.of(cfg.cluster.env, cfg.logger.redact))
    payload = {}
    for bench in sorted({r["bench"] for r in records}):
        rows = [r for r in records if r["bench"] == bench]
        cols = sorted({k for r in rows for k in r})
        payload[f"bench/{bench}"] = wandb.Table(
            columns=cols, data=[[_fmt(r.get(c)) for c in cols] for r in rows])
    for name, path in plots.items():
        payload[f"bench_plot/{name}"] = wandb.Image(path)
    wandb.log(payload)
    for key, value in summary.items():
        wandb.run.summary[f"bench/{key}"] = value
    if own is not None:
        own.close()

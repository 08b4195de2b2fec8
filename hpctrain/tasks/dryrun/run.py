"""task=dryrun: chosen ranks of a job set up for real on one CPU, against the planner.

For each rank of `dryrun.ranks` (default: the first rank of each pipeline stage and the last
global rank) `hpctrain.tasks.dryrun.rank.measure_rank` sets the rank up exactly as the job
would, at the job's full world size, on meta tensors, and runs one step's forward and
backward; this module sets the planner's prediction for the same rank beside it
(`hpctrain.plan.memory.model`, the one memory model: the rank's pipeline stage, its
microbatches in flight at the peak), term by term, and the verdict against the usable
memory of `parallel=auto` and the pre-launch check (`hpctrain.plan.auto`: the limit less
plan.headroom). A term off by more than `dryrun.tolerance` is a planner or a code bug.

Outputs in the run dir: dryrun.json (per rank: rank, coords, the measured *_bytes,
`predicted` with the same keys, the seconds its set-up took) and dryrun.md (the tables).
Mixture-of-experts models route at the planner's stated bound (meta tensors make no routing
choice: `hpctrain.models.moe.router.bound_routing`), so their routed terms are the bound's. The
fused attention backends whose kernels need a device (flash, flex, triton) are set up as sdpa: every
fused backend saves the same query, key, value, output and log-sum-exp for backward
(plan.memory.FUSED_ATTENTION), and the report says so (`on_meta`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from hpctrain.config.dryrun import chosen_ranks, dryrun_settings
from hpctrain.config.schema import Config
from hpctrain.plan.auto import memory_limit, planning_cluster, usable_bytes
from hpctrain.plan.bubble import in_flight_by_rank
from hpctrain.plan.comm_volume import Volume, step_volumes
from hpctrain.plan.inputs import layout_of, step_shape
from hpctrain.plan.memory.formulas import FUSED_ATTENTION, fp8_buffer_bytes
from hpctrain.plan.memory.model import (
    engine_states,
    gathered_bytes,
    rank_activations,
    rank_checkpoint_bytes,
)
from hpctrain.plan.search import GIB
from hpctrain.tasks.dryrun.comm import comm_rows

TERMS = ("params", "grads", "optim", "gathered", "buffers", "activations", "checkpoint")


def predicted_rank(cfg: Config, rank: int) -> dict[str, float]:
    """The planner's bytes for global `rank` (its pipeline stage), keyed as `TERMS`. FP8's
    float8 weight copies are saved for backward, so they join the activations, as the meter
    sees them; the planner has no module buffers (hpctrain's modules register none)."""
    layout = layout_of(cfg)
    step = dataclasses.replace(step_shape(cfg), packed=False)  # the dry run's whole rows
    dims = cfg.parallel.dims
    pp_rank = dims.coords(rank)["pp"]
    first_replica = dims.coords(rank)["dp"] < dims.dp_shard  # HSDP: the first replica writes
    in_flight = in_flight_by_rank(layout.schedule, pp=layout.pp, m=cfg.grad_accum,
                                  v=layout.virtual_stages)
    states = engine_states(cfg.model, layout, step, pp_rank=pp_rank)
    acts = rank_activations(cfg.model, layout, step)[pp_rank]
    if step.fp8:
        acts += fp8_buffer_bytes(cfg.model, layout, in_flight=in_flight[pp_rank],
                                 recompute=step.recompute)
    return {"params": states.params, "grads": states.grads, "optim": states.optimizer,
            "gathered": gathered_bytes(cfg.model, layout, step), "buffers": 0.0,
            "activations": acts,
            "checkpoint": rank_checkpoint_bytes(cfg.model, layout, pp_rank=pp_rank)
            if first_replica else 0.0,
            "host": states.host}


def predicted_comm(cfg: Config, rank: int) -> dict[str, Volume]:
    """The planner's collectives of global `rank`'s step, per mesh group
    (`plan.comm_volume`)."""
    step = dataclasses.replace(step_shape(cfg), packed=False)
    return step_volumes(cfg.model, layout_of(cfg), step,
                        pp_rank=cfg.parallel.dims.coords(rank)["pp"])


def on_meta(cfg: Config) -> tuple[Config, str | None]:
    """`cfg` as the dry run sets it up on meta tensors, and the note saying what it changed:
    a fused attention backend whose kernels need a device runs as sdpa (the same saved
    tensors; module docstring)."""
    attention = cfg.model.attention
    if attention == "sdpa" or attention not in FUSED_ATTENTION:
        return cfg, None
    note = (f"model.attention={attention} is set up as sdpa on meta tensors (its kernels need "
            "a device; every fused backend saves the same q, k, v, output and log-sum-exp)")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="sdpa")), note


def run_dryrun(cfg: Config) -> dict[str, Any]:
    """Every chosen rank measured and predicted (module docstring); writes dryrun.json and
    dryrun.md, returns {"text", "path", "fits", "ranks"}."""
    from hpctrain.tasks.dryrun.rank import measure_rank

    settings, dims = dryrun_settings(cfg), cfg.parallel.dims
    usable = usable_bytes(cfg, planning_cluster(cfg))
    limited = memory_limit(cfg, planning_cluster(cfg)) is not None
    rows, (meta_cfg, note) = [], on_meta(cfg)
    for rank in chosen_ranks(cfg):
        t0 = time.perf_counter()
        measured, seconds, comm = measure_rank(meta_cfg, rank)
        total = measured.device_total
        rows.append({"rank": rank, "coords": dims.coords(rank),
                     **{f"{k}_bytes": v for k, v in measured.as_dict().items()},
                     "total_bytes": total,
                     "predicted": {f"{k}_bytes": v for k, v in predicted_rank(cfg, rank).items()},
                     "comm": comm_rows(comm, predicted_comm(cfg, rank)),
                     "fits": (not limited) or total <= usable,
                     "seconds": {**seconds, "total_s": time.perf_counter() - t0}})
    out = Path(cfg.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"world_size": dims.world_size, "layout": layout_of(cfg).describe(),
              "usable_bytes": usable if limited else None, "note": note,
              "tolerance": settings.tolerance, "ranks": rows}
    (out / "dryrun.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    text = dryrun_table(report)
    (out / "dryrun.md").write_text(text + "\n", encoding="utf-8")
    return {"text": text, "path": str(out / "dryrun.json"),
            "fits": all(r["fits"] for r in rows), "ranks": rows}


def overflow_problems(result: dict[str, Any], *, usable: float) -> list[str]:
    """One line per rank of a dry run (`run_dryrun`'s result) that does not fit: its total,
    the usable bytes, and its largest term."""
    out = []
    for row in result["ranks"]:
        if row["fits"]:
            continue
        terms = {t: row[f"{t}_bytes"] for t in TERMS if t != "checkpoint"}
        worst = max(terms, key=terms.get)
        coords = " ".join(f"{k}={v}" for k, v in row["coords"].items())
        out.append(f"rank {row['rank']} ({coords}) would hold {size_text(row['total_bytes'])} "
                   f"on its device, above the usable {size_text(usable)}; its largest term is "
                   f"{worst}: {size_text(terms[worst])} ("
                   + ", ".join(f"{t} {size_text(v)}" for t, v in terms.items()) + ")")
    return out


def check_before_submit(cfg: Config, *, run_dir: Path) -> None:
    """cluster.check_before_submit: the dry run of the job about to be submitted, its report
    in `run_dir`; ValueError naming each rank that does not fit, its largest term and the
    fixes (nothing is submitted)."""
    result = run_dryrun(dataclasses.replace(cfg, run_dir=str(run_dir)))
    if result["fits"]:
        return
    usable = usable_bytes(cfg, planning_cluster(cfg))
    raise ValueError(
        "cluster.check_before_submit: the dry run of this job found rank(s) that do not fit; "
        "nothing was submitted:\n  " + "\n  ".join(overflow_problems(result, usable=usable))
        + f"\n(tables: {run_dir / 'dryrun.md'}) raise parallel.zero or parallel.tp/pp, set "
        "train.activation_checkpointing=full, lower train.micro_batch_size, or use "
        "parallel=auto")


def dryrun_table(report: dict[str, Any]) -> str:
    """Per rank: measured on meta vs predicted, GiB, every term, flagged beyond tolerance;
    then its total and verdict."""
    tol, usable = report["tolerance"], report["usable_bytes"]
    lines = [f"dry run of {report['layout']} ({report['world_size']} ranks); usable per rank: "
             + (size_text(usable) if usable else "no limit known")]
    if report.get("note"):
        lines.append(report["note"])
    for row in report["ranks"]:
        coords = " ".join(f"{k}={v}" for k, v in row["coords"].items())
        lines += ["", f"rank {row['rank']} ({coords}), set up in "
                  f"{row['seconds']['total_s']:.1f} s",
                  "| term | measured | predicted | measured / predicted |",
                  "|---|---:|---:|---:|"]
        for term in TERMS:
            m, p = row[f"{term}_bytes"], row["predicted"][f"{term}_bytes"]
            lines.append(f"| {term} | {size_text(m)} | {size_text(p)} | {_ratio(m, p, tol)} |")
        verdict = "fits" if row["fits"] else "DOES NOT FIT"
        lines.append(f"| device total | {size_text(row['total_bytes'])} | | {verdict} |")
        lines.append(f"| set-up host transient | {size_text(row['setup_host_bytes'])} | | "
                     "one full parameter in fp32 |")
        lines += ["", "| group | collectives | predicted | sent | predicted | sent / predicted |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, c in row["comm"].items():
            lines.append(f"| {name} | {c['ops']} | {c['predicted_ops']:g} | "
                         f"{size_text(c['bytes'])} | {size_text(c['predicted_bytes'])} | "
                         f"{_ratio(c['bytes'], c['predicted_bytes'], tol)} |")
    return "\n".join(lines)


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps a number ≥ 1 (B, KiB, MiB, GiB)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ratio(measured: float, predicted: float, tol: float) -> str:
    if predicted == 0:
        return "—" if measured == 0 else "(none predicted) ✘"
    r = measured / predicted
    return f"{r:.3f}" + (" ✘" if abs(r - 1) > tol else "")

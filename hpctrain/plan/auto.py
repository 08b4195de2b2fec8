"""The planner before launch: `parallel=auto` chooses the layout, and a hand-written layout
predicted not to fit is refused.

`choose_layout(cfg, accept=...)` searches dp, cp, tp, pp, schedule, virtual stages, ZeRO stage
and activation checkpointing for the model, the job's ranks and the batch
(`hpctrain.plan.search`), and returns `cfg` with the fastest candidate that fits under the
memory headroom and that `accept` (the caller's full config validation: "the launcher runs
it") finds no problem with. Offload is tried only when nothing fits without it. The search
is deterministic: every Slurm task that parses the same config gets the same layout.

The cluster it plans for (`planning_cluster`): cluster.accelerator / cluster.calibration when
set (`plan.task.cluster_spec`); otherwise this machine as a nominal CPU device (NOMINAL_CPU_FLOPS,
the LOCAL_* gloo links) whose memory is plan.memory_limit_gb, or the host's RAM shared by the
node's ranks. Nothing is measured, so the choice cannot differ between ranks.

Memory limit (`memory_limit`): plan.memory_limit_gb, else the accelerator's memory, else for
CPU ranks launched on this machine its physical memory shared by them; a layout
fits when its predicted peak (model states + activations + buffers, `plan.memory`) is at most
(1 − plan.headroom) × the limit. `fit_problems` refuses a hand-written layout above it before
any rank starts, naming the numbers and the fastest layout that fits; plan.force=true runs it
anyway. A CPU run under Slurm with no plan.memory_limit_gb has no limit to refuse against
(the node's memory is not known at launch).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctrain.config.plan import plan_settings
from hpctrain.config.schema import Config, fixed_values
from hpctrain.distributed.device import resolve_device_type
from hpctrain.metrics.devices import DeviceSpec
from hpctrain.plan.calibrate import local_cluster
from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.inputs import cluster_spec, layout_of
from hpctrain.plan.layout import Layout
from hpctrain.plan.predict import predicted_peak
from hpctrain.plan.search import GIB, Candidate, evaluate_layout, search_layouts

log = logging.getLogger(__name__)
# Keys the search chooses, which parallel.fixed may keep as given: the Layout's fields and the
# recompute. schedule and virtual_stages bind pipelined layouts (pp > 1) only, sp tensor-parallel
# ones (tp > 1): a layout without a pipeline has no schedule to keep.
_ONLY_WHEN = {"schedule": "pp", "virtual_stages": "pp", "sp": "tp"}
NOMINAL_CPU_FLOPS = 50e9  # only ranks layouts; the time model's own numbers need a device row
Accept = Callable[[Config], list[str]]


def planning_cluster(cfg: Config) -> ClusterSpec:
    """The ClusterSpec the pre-launch planner uses (module docstring)."""
    c = cfg.cluster
    if c.accelerator is not None or c.calibration is not None:
        return cluster_spec(cfg)
    limit = plan_settings(cfg).memory_limit_gb
    device = DeviceSpec(name="cpu (nominal)", bf16_flops=NOMINAL_CPU_FLOPS,
                        fp16_flops=NOMINAL_CPU_FLOPS, fp32_flops=NOMINAL_CPU_FLOPS,
                        memory_bytes=int(limit * GIB) if limit else host_bytes_per_rank(cfg),
                        hbm_bandwidth=float("nan"))
    return local_cluster(device, gpus_per_node=c.procs_per_node,
                         achievable_fraction=c.achievable_fraction)


def host_bytes_per_rank(cfg: Config) -> int:
    """This host's physical memory shared by the node's ranks."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, cfg.cluster.procs_per_node)


def _on_this_host_cpu(cfg: Config) -> bool:
    """The ranks run on this machine's CPUs: its memory is theirs (a Slurm node's is unknown
    here)."""
    return (cfg.cluster.launcher == "local" and cfg.cluster.accelerator is None
            and resolve_device_type(cfg.cluster.device) == "cpu")


def memory_limit(cfg: Config, cluster: ClusterSpec) -> float | None:
    """Bytes one rank may use, before headroom: plan.memory_limit_gb, the accelerator's
    memory, or for CPU ranks on this machine its memory shared by them; None when there is
    nothing to check against."""
    limit = plan_settings(cfg).memory_limit_gb
    if limit is not None:
        return limit * GIB
    if cfg.cluster.accelerator is not None:
        return float(cluster.device.memory_bytes)
    if _on_this_host_cpu(cfg):
        return float(host_bytes_per_rank(cfg))
    return None


def _limit_source(cfg: Config) -> str:
    if plan_settings(cfg).memory_limit_gb is not None:
        return "plan.memory_limit_gb"
    if cfg.cluster.accelerator is not None:
        return f"the memory of cluster.accelerator={cfg.cluster.accelerator}"
    return (f"this host's memory shared by cluster.procs_per_node={cfg.cluster.procs_per_node}"
            " ranks")


def usable_bytes(cfg: Config, cluster: ClusterSpec) -> float:
    """Bytes one rank may use: `memory_limit` (else the device's memory) less plan.headroom."""
    limit = memory_limit(cfg, cluster)
    return (limit if limit is not None else cluster.device.memory_bytes) * (
        1 - plan_settings(cfg).headroom)


def _keeps(cfg: Config) -> Callable[[Layout, str], bool] | None:
    """The search's filter: (layout, recompute) pairs that keep every fixed value."""
    fixed = fixed_values(cfg)
    if not fixed:
        return None

    def keeps(layout: Layout, recompute: str, key: str, value: Any) -> bool:
        group, name = key.split(".")
        if group == "train":
            return recompute == value
        unbound = name in _ONLY_WHEN and getattr(layout, _ONLY_WHEN[name]) == 1
        return unbound or getattr(layout, name) == value

    def where(layout: Layout, recompute: str) -> bool:
        return all(keeps(layout, recompute, k, v) for k, v in fixed.items())

    return where


def with_layout(cfg: Config, c: Candidate) -> Config:
    """`cfg` running candidate `c`: its whole layout (every axis, schedule, ZeRO, offload) and
    its recompute."""
    train = dataclasses.replace(cfg.train, activation_checkpointing=c.recompute)
    return dataclasses.replace(cfg, parallel=c.layout.applied_to(cfg.parallel), train=train)


def candidates(cfg: Config, *, accept: Accept | None = None) -> list[Candidate]:
    """Every layout of the job's ranks, scored, fitting ones fastest first (`search_layouts`),
    `fits` judged against the usable memory (limit less headroom). The five fastest that
    `accept` takes (no problems) are simulated exactly; slower ones keep their lower bound."""
    cluster, t, settings = planning_cluster(cfg), cfg.train, plan_settings(cfg)
    usable = usable_bytes(cfg, cluster)
    budget = cluster.with_(device=dataclasses.replace(cluster.device, memory_bytes=int(usable)))
    n = cfg.cluster.world_size
    found = search_layouts(
        cfg.model, budget, n_devices=n, global_batch=t.global_batch_size,
        micro_batch_size=t.micro_batch_size, seq_len=t.seq_len, precision=t.precision,
        schedules=list(settings.schedules), zero_stages=list(settings.zero_stages),
        dp_overlap=settings.dp_overlap,
        context_parallel=[d for d in range(1, n + 1) if n % d == 0], exact_top=settings.top,
        accept=None if accept is None else (lambda c: not accept(with_layout(cfg, c))),
        where=_keeps(cfg), zero3_reshard=t.zero3_reshard_after_forward)
    if any(c.fits for c in found):
        return found
    where = _keeps(cfg) or (lambda layout, recompute: True)
    kw = dict(global_batch=t.global_batch_size, micro_batch_size=t.micro_batch_size,
              seq_len=t.seq_len, precision=t.precision, dp_overlap=settings.dp_overlap,
              zero3_reshard=t.zero3_reshard_after_forward)
    offloaded = [evaluate_layout(cfg.model, budget, dataclasses.replace(c.layout, offload="cpu"),
                                 c.recompute, **kw) for c in found if c.layout.pp == 1]
    offloaded = [c for c in offloaded if where(c.layout, c.recompute)]
    fitting = sorted((c for c in offloaded if c.fits), key=lambda c: c.time.step_time_s)
    return fitting + found


def ranked(cfg: Config, *, accept: Accept) -> list[tuple[Candidate, str]]:
    """(candidate, reason) pairs: the chosen one first ('best'), then the rest in search order,
    each saying why it lost: slower (by how much), refused by hpctrain, or does not fit."""
    out, best = [], None
    runnable, top = _with_fit_check(cfg, accept), plan_settings(cfg).top
    for c in candidates(cfg, accept=runnable):
        if not c.fits or (best is not None and len(out) >= top):
            out.append((c, c.reason))  # past the listed top: the search's reason, unchecked
            continue
        problems = runnable(with_layout(cfg, c))
        if problems:
            out.append((c, "hpctrain cannot run it: " + problems[0]))
        elif best is None:
            best = c
            out.insert(0, (c, "best"))
        else:
            out.append((c, _lost(c, best)))
    return out


def _with_fit_check(cfg: Config, accept: Accept) -> Accept:
    """`accept`, then the pre-launch memory check (`fit_problems`' run prediction, which
    models hpctrain's engine byte for byte; the search's `fits` is the planner's general
    model): auto never picks a layout that the check before launch would refuse."""
    limit = memory_limit(cfg, planning_cluster(cfg))
    usable = None if limit is None else limit * (1 - plan_settings(cfg).headroom)

    def check(candidate_cfg: Config) -> list[str]:
        problems = accept(candidate_cfg)
        if problems or usable is None or candidate_cfg.task != "train":
            return problems
        need = predicted_peak(candidate_cfg)["total"]
        if need > usable:
            return [f"the run prediction needs {need / GIB:.3g} GiB per rank > "
                    f"{usable / GIB:.3g} GiB usable"]
        return []

    return check


def _lost(c: Candidate, best: Candidate) -> str:
    """Why a runnable, fitting candidate lost to `best`, as a sentence (the search's order:
    time, then lower ZeRO stage, less recomputation, less memory)."""
    ratio = c.time.step_time_s / best.time.step_time_s
    if not c.exact:  # pruned by the search: its bound already loses
        return (f"Even before its pipeline bubble it is {ratio:.2f}× slower per step than the "
                f"chosen layout, so it was not simulated.")
    if ratio >= 1.005:
        return f"It is {ratio:.2f}× slower per step than the chosen layout{_notes(c)}."
    same = f"It is as fast as the chosen layout ({ratio:.3f}× its step time)"
    if c.layout.zero != best.layout.zero:
        return (f"{same}, but shards with ZeRO stage {c.layout.zero} where stage "
                f"{best.layout.zero} is as fast; on a tie the lower stage wins (fewer "
                f"collectives per step).")
    if c.recompute != best.recompute:
        return (f"{same}, but recomputes activations ({c.recompute}) where {best.recompute} is "
                f"as fast; on a tie less recomputation wins.")
    return (f"{same}, but needs {c.memory.total / best.memory.total:.2f}× its memory; on a tie "
            f"less memory wins.")


def _notes(c: Candidate) -> str:
    notes = ([f"its pipeline bubble is {c.time.bubble_fraction:.0%} of the step"]
             if c.time.bubble_fraction > 0.1 else [])
    if c.time.comm_dp_s > 0.2 * c.time.step_time_s:
        notes.append(f"data-parallel communication takes "
                     f"{c.time.comm_dp_s / c.time.step_time_s:.0%} of it")
    return f": {' and '.join(notes)}" if notes else ""


def choose_layout(cfg: Config, *, accept: Accept) -> tuple[Config, list[tuple[Candidate, str]]]:
    """`cfg` with the chosen layout, and the ranking (module docstring). ValueError with the
    closest candidates' numbers when no layout fits and runs."""
    order = ranked(cfg, accept=accept)
    if not order and cfg.parallel.fixed:
        given = ", ".join(f"{k}={v}" for k, v in fixed_values(cfg).items())
        raise ValueError(f"parallel=auto: no layout of {cfg.model.name} on "
                         f"{cfg.cluster.world_size} rank(s) keeps {given}: change or drop them "
                         "and the search chooses")
    refused = {why for c, why in order if c.fits}
    if order and order[0][1] != "best" and len(refused) == 1:  # not the layouts' fault
        raise ValueError(f"parallel=auto: every layout that fits is refused: {refused.pop()}")
    if not order or order[0][1] != "best":
        closest = "; ".join(f"{c.layout.describe()} {c.recompute}: {c.memory.total / GIB:.3g} "
                            f"GiB ({why})" for c, why in order[:3])
        usable = usable_bytes(cfg, planning_cluster(cfg)) / GIB
        raise ValueError(
            f"parallel=auto found no layout of {cfg.model.name} on {cfg.cluster.world_size} "
            f"rank(s){_keeping(cfg)} that fits {usable:.3g} GiB per rank (after plan.headroom="
            f"{plan_settings(cfg).headroom}) and that hpctrain runs; closest: "
            f"{closest or 'none'}. "
            "Add ranks (cluster.nodes / cluster.procs_per_node), lower "
            "train.micro_batch_size, or raise plan.memory_limit_gb")
    return with_layout(cfg, order[0][0]), order


def _keeping(cfg: Config) -> str:
    fixed = fixed_values(cfg)
    if not fixed:
        return ""
    given = ", ".join(f"{k}={v}" for k, v in fixed.items())
    return f" keeping {given} as given (drop them to search every layout)"


def fit_problems(cfg: Config, *, accept: Accept) -> list[str]:
    """A training layout predicted above the usable memory, unless plan.force (module doc)."""
    settings = plan_settings(cfg)
    if cfg.task != "train" or settings.force:
        return []
    limit = memory_limit(cfg, planning_cluster(cfg))
    if limit is None:
        return []
    mem = predicted_peak(cfg)
    if mem["total"] <= limit * (1 - settings.headroom):
        return []
    try:
        better = choose_layout(cfg, accept=accept)[1][0][0]
        fix = f"use parallel=auto (it would run {better.layout.describe()} {better.recompute})"
    except ValueError:
        fix = ("make the model smaller or lower train.micro_batch_size (no layout of this job "
               "fits; more ranks on this host share the same memory)" if _on_this_host_cpu(cfg)
               else "add ranks or lower train.micro_batch_size (no layout of this job fits)")
    return [f"{layout_of(cfg).describe()} with train.activation_checkpointing="
            f"{cfg.train.activation_checkpointing} is predicted to need {mem['total'] / GIB:.3g} "
            f"GiB per rank (model states {mem['states'] / GIB:.3g}, activations "
            f"{mem['activations'] / GIB:.3g}) but "
            f"{(1 - settings.headroom):.0%} of {limit / GIB:.3g} GiB is "
            f"{limit * (1 - settings.headroom) / GIB:.3g} GiB ({_limit_source(cfg)}, "
            f"plan.headroom={settings.headroom}): {fix}, raise parallel.zero, set "
            "train.activation_checkpointing=full, or plan.force=true to run it anyway"]


def _row(c: Candidate, reason: str) -> dict[str, Any]:
    return {"layout": c.layout.describe(), "recompute": c.recompute, "fits": c.fits,
            "memory_total_bytes": c.memory.total, "memory_activation_bytes": c.memory.activations,
            "step_time_s": c.time.step_time_s, "bubble_fraction": c.time.bubble_fraction,
            "reason": reason}


def write_plan(cfg: Config, *, accept: Accept, top: int | None = None) -> dict[str, Any]:
    """Log the chosen layout and the top five (plan.top) with why each lost, and write them
    into `plan.json` in the run dir. Called once per job, before the ranks start."""
    order = ranked(cfg, accept=accept)
    top = top or plan_settings(cfg).top
    rows = [_row(c, why) for c, why in order]
    width = max(len(r["layout"]) + len(r["recompute"]) for r in rows[:top]) + 2
    table = "\n".join(f"  {i}. {r['layout'] + ' ' + r['recompute']:<{width}} "
                      f"{r['step_time_s']:.4g} s  {r['memory_total_bytes'] / GIB:.3g} GiB  "
                      f"{r['reason']}" for i, r in enumerate(rows[:top], 1))
    cluster = planning_cluster(cfg)
    log.info("parallel=auto chose %s on %d rank(s) of %s%s; top %d:\n%s", rows[0]["layout"],
             cfg.cluster.world_size, cluster.device.name, _keeping(cfg), top, table)
    doc = {"auto": True, "fixed": fixed_values(cfg), "chosen": rows[0], "top": rows[:top],
           "n_candidates": len(rows),
           "device": cluster.device.name, "memory_limit_bytes": memory_limit(cfg, cluster),
           "headroom": plan_settings(cfg).headroom, "world_size": cfg.cluster.world_size}
    out = Path(cfg.run_dir) / "plan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return doc

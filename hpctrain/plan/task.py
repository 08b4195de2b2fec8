"""task=plan: predict memory and step time for the configured layout, or search for the best.

Runs once, with no ranks. The model, layout, batch and precision come from the usual groups;
the cluster's accelerator and links from `cluster.accelerator`, `cluster.intra_node_gb_s`,
`cluster.inter_node_gb_s`, `cluster.achievable_fraction` (GPUs per node = procs_per_node); the
pipeline's in-flight microbatches from the simulator. Writes `plan.json` into the run dir and
returns its table (the CLI prints it on stdout); with `plan.search=true` also ranks every
valid layout for `plan.n_devices`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.config import Config
from hpctrain.config_build import build
from hpctrain.metrics.devices import DEVICES, lookup_device
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.plan.bubble import in_flight_microbatches
from hpctrain.plan.calibrate import calibrated_cluster, local_cluster
from hpctrain.plan.calibrate_run import read_run, refine, run_device
from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.layout import Layout
from hpctrain.plan.report import format_plan_table, format_search_table, plan_report
from hpctrain.plan.search import GIB, search_layouts
from hpctrain.plan.time import step_time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanConfig:
    """The `plan` group (task=plan). Ranges: validate_keys.PLAN_RANGES; zero_stages and
    schedules (a registry) are checked by validate.check_plan."""

    search: bool = False  # rank every valid layout of n_devices, not only the configured one
    n_devices: int | None = None  # devices to lay out when searching (None: nodes × procs)
    top: int = 5  # layouts listed by the search
    dp_overlap: float = 0.0  # fraction of dp gradient communication hidden behind backward
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)  # the search tries these ZeRO stages ...
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "zb_h1")  # ... and schedules
    # Typical document length (tokens) of rows packed with data.packing=documents: attention
    # FLOPs count min(it, seq_len) keys per token instead of seq_len. None: whole rows.
    document_tokens: int | None = None
    # Before a training run (hpctrain.plan.auto): a layout whose predicted peak bytes per rank
    # exceed (1 − headroom) × the device memory is refused, unless force. memory_limit_gb
    # (GiB) replaces the device table's memory; on a CPU without it nothing is refused.
    headroom: float = 0.1
    memory_limit_gb: float | None = None
    force: bool = False
    # A finished training run's dir: its measured step times refine its device's in-step GEMM
    # (and fused-attention) rate, achievable_fraction, reporting the step-time error before and
    # after; a plan for another device is refused; without cluster.accelerator its measured
    # device is the plan's (hpctrain.plan.calibrate_run)
    calibrate_from: str | None = None


def plan_settings(cfg: Config) -> PlanConfig:
    """The `plan` group of `cfg.extra` as a PlanConfig; ValueError naming every unknown (with
    a "did you mean") or mistyped key."""
    return build(PlanConfig, "plan", cfg.extra.get("plan") or {})


def cluster_spec(cfg: Config) -> ClusterSpec:
    """The table row of cluster.accelerator with the cluster.*_gb_s links; with
    cluster.calibration, a bench.json's measurements replace them (alone when no accelerator)."""
    c = cfg.cluster
    if c.accelerator is None and c.calibration is not None:
        return calibrated_cluster(c.calibration).with_(
            gpus_per_node=c.procs_per_node, achievable_fraction=c.achievable_fraction)
    if c.accelerator is None:
        raise ValueError("task=plan needs cluster.accelerator (one of "
                         f"{', '.join(DEVICES)}), e.g. cluster.accelerator=H100-SXM, "
                         "or cluster.calibration=<a task=bench bench.json>")
    device = lookup_device(c.accelerator)
    if device is None:
        raise ValueError(f"cluster.accelerator={c.accelerator!r} is not in the device table; "
                         f"choose one of {', '.join(DEVICES)}")
    spec = ClusterSpec(device=device, gpus_per_node=c.procs_per_node,
                       intra_node_bw=c.intra_node_gb_s * 1e9,
                       inter_node_bw=c.inter_node_gb_s * 1e9,
                       achievable_fraction=c.achievable_fraction)
    return spec if c.calibration is None else calibrated_cluster(c.calibration, base=spec)


def plan_cluster(cfg: Config) -> tuple[ClusterSpec, dict[str, Any] | None]:
    """`cluster_spec`, refined by plan.calibrate_from when set (with what it changed): exactly,
    by this plan's step time, when the plan is the run's layout (`calibrate_run.refine`)."""
    source = plan_settings(cfg).calibrate_from
    if source is None:
        return cluster_spec(cfg), None
    run, c = read_run(source), cfg.cluster
    if c.accelerator is None and c.calibration is None:
        base = local_cluster(run_device(run, precision=cfg.train.precision),
                             gpus_per_node=c.procs_per_node,
                             achievable_fraction=c.achievable_fraction)
    else:
        base = cluster_spec(cfg)
    layout = f"{layout_of(cfg).describe()} {cfg.train.activation_checkpointing}"
    cluster, record = refine(base, run, step_time_of=lambda spec: _step_seconds(cfg, spec),
                             plan_layout=layout)
    return cluster, {"from": str(source), **record}


def _step_seconds(cfg: Config, cluster: ClusterSpec) -> float:
    """The step time `run_plan` reports for `cfg` on `cluster`."""
    t, settings = cfg.train, plan_settings(cfg)
    attended = (None if settings.document_tokens is None
                else min(settings.document_tokens, t.seq_len))
    return step_time(cfg.model, cluster, layout=layout_of(cfg),
                     global_batch=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                     seq_len=t.seq_len, recompute=t.activation_checkpointing,
                     precision=t.precision, dp_overlap=settings.dp_overlap,
                     attended_per_token=attended,
                     fp8=t.fp8 and cluster.device.fp8_flops is not None).step_time_s


def simulated_in_flight(cfg: Config) -> int:
    """Peak (microbatch, chunk) activation sets on the busiest rank, from the real schedule
    (`hpctrain.plan.bubble`; 1 without pp)."""
    p = cfg.parallel
    if p.pp == 1:
        return 1
    layout = layout_of(cfg)
    build_schedule(p.schedule, pp=p.pp, microbatches=cfg.grad_accum,
                   virtual_stages=p.virtual_stages)  # the runtime's checks, same messages
    return in_flight_microbatches(layout.schedule, pp=p.pp, m=cfg.grad_accum,
                                  v=layout.virtual_stages)


def layout_of(cfg: Config) -> Layout:
    return Layout.of(cfg.parallel)


def run_plan(cfg: Config) -> dict[str, Any]:
    settings, t = plan_settings(cfg), cfg.train
    cluster, calibration = plan_cluster(cfg)
    attended = (None if settings.document_tokens is None
                else min(settings.document_tokens, t.seq_len))
    common = dict(global_batch=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                  seq_len=t.seq_len, precision=t.precision, attended_per_token=attended,
                  fp8=t.fp8 and cluster.device.fp8_flops is not None)
    # fits: against the memory parallel=auto and the pre-launch check use (the limit less
    # plan.headroom), so the three never disagree
    limit = (settings.memory_limit_gb * GIB if settings.memory_limit_gb is not None
             else cluster.device.memory_bytes)
    usable = limit * (1 - settings.headroom)
    report = plan_report(cfg.model, cluster, layout=layout_of(cfg),
                         recompute=t.activation_checkpointing, in_flight=simulated_in_flight(cfg),
                         dp_overlap=settings.dp_overlap, usable_bytes=usable, **common)
    if calibration is not None:
        report["calibration"] = calibration
        log.info("calibrated %s from %s (%s): achievable_fraction %.3g → %.3g, step-time "
                 "error %+.1f%% → %+.1f%%", calibration["device"], calibration["from"],
                 calibration["method"], calibration["achievable_fraction_before"],
                 calibration["achievable_fraction"], 100 * calibration["error_before"],
                 100 * calibration["error_after"])
    text = [f"plan for {cfg.model.name} on {cluster.device.name}:", format_plan_table(report)]
    if settings.search:
        n = settings.n_devices or cfg.cluster.world_size
        budget = cluster.with_(device=dataclasses.replace(cluster.device,
                                                          memory_bytes=int(usable)))
        found = search_layouts(cfg.model, budget, n_devices=n, dp_overlap=settings.dp_overlap,
                               schedules=list(settings.schedules),
                               zero_stages=list(settings.zero_stages),
                               exact_top=settings.top, **common)
        text += [f"best layouts for {n} devices:", format_search_table(found, top=settings.top)]
        report["search"] = [_candidate_json(c) for c in found]
    out = Path(cfg.run_dir) / "plan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    report["path"] = str(out)
    report["text"] = "\n".join(text)  # printed on stdout by the CLI (hpctrain.cli.format_result)
    return report


def _candidate_json(c) -> dict[str, Any]:
    return {"layout": c.layout.describe(), "recompute": c.recompute, "fits": c.fits,
            "memory_total_bytes": c.memory.total, "step_time_s": c.time.step_time_s,
            "mfu": c.time.mfu, "reason": c.reason}

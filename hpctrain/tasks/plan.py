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
from pathlib import Path
from typing import Any

from hpctrain.config.plan import plan_settings
from hpctrain.config.schema import Config
from hpctrain.plan.inputs import layout_of, plan_cluster, simulated_in_flight
from hpctrain.plan.report import format_plan_table, format_search_table, plan_report
from hpctrain.plan.search import GIB, search_layouts

log = logging.getLogger(__name__)


def run_plan(cfg: Config) -> dict[str, Any]:
    settings, t = plan_settings(cfg), cfg.train
    cluster, calibration = plan_cluster(cfg)
    attended = (None if settings.document_tokens is None
                else min(settings.document_tokens, t.seq_len))
    common = dict(global_batch=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                  seq_len=t.seq_len, precision=t.precision, attended_per_token=attended,
                  fp8=t.fp8 and cluster.device.fp8_flops is not None,
                  zero3_reshard=t.zero3_reshard_after_forward)
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
    report["text"] = "\n".join(text)  # shown on stdout (hpctrain.tasks.TASKS)
    return report


def _candidate_json(c) -> dict[str, Any]:
    return {"layout": c.layout.describe(), "recompute": c.recompute, "fits": c.fits,
            "memory_total_bytes": c.memory.total, "step_time_s": c.time.step_time_s,
            "mfu": c.time.mfu, "reason": c.reason}

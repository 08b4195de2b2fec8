"""What the planner reads of a run's Config: the cluster it plans for (the accelerator's row,
the links, a bench.json's calibration, a finished run's refinement), the layout, and the
micro-batches the schedule keeps in flight."""

from __future__ import annotations

from typing import Any

from hpctrain.config.plan import plan_settings
from hpctrain.config.schema import Config
from hpctrain.metrics.devices import DEVICES, lookup_device
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.plan.bubble import in_flight_microbatches
from hpctrain.plan.calibrate import calibrated_cluster, local_cluster
from hpctrain.plan.calibrate_run import read_run, refine, run_device
from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.model import StepShape
from hpctrain.plan.time import step_time


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


def step_shape(cfg: Config) -> StepShape:
    """What a step of `cfg` holds and sends beyond its layout (`plan.memory.model`)."""
    t = cfg.train
    return StepShape(seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
                     microbatches=cfg.grad_accum, recompute=t.activation_checkpointing,
                     precision=t.precision, fp8=t.fp8, bucket_mb=cfg.parallel.bucket_mb,
                     checkpoint_async=cfg.train.checkpoint_async,
                     packed=cfg.data.packing != "none",
                     grad_comm_dtype=cfg.parallel.grad_comm_dtype,
                     zero3_reshard=t.zero3_reshard_after_forward)


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
                     fp8=t.fp8 and cluster.device.fp8_flops is not None,
                     issued=step_shape(cfg)).step_time_s


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

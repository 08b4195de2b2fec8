"""What the planner predicts for the run about to train, and how the run compares.

`predict_run(cfg, device=...)` gives, for this Config's layout, the per-rank model-state bytes
and the step time; the trainer logs them once next to what it measures (issue 8: the cost model
is checked on every run). The cluster the step time uses (`run_cluster`), in order:

  1. cluster.calibration set: the bench.json's measured GEMM peak and links
     (`hpctrain.plan.calibrate.calibrated_cluster`) over the accelerator's row if one is set;
  2. cluster.accelerator set: the device table and the cluster.*_gb_s links;
  3. otherwise: this device, calibrated on the spot by a ≈0.2 s GEMM of the model's largest
     projection in the training precision (the "peak" is then measured GEMM throughput;
     achievable_fraction still applies), with the LOCAL_* link constants.

Memory: the planner's one model (`hpctrain.plan.memory.model`), the one the layout search,
`parallel=auto` and the pre-launch check use: every layout runs on the flat engine, whose
units are predicted exactly with their padding on the rank's tp slices and pipeline chunks
(`hpctrain.plan.memory.states`); routed experts get the analytical `rank_state_bytes` (experts
1/ep, their ZeRO states over dp/ep): the engine's expert units are not modelled element by
element.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hpctrain.config.schema import Config
from hpctrain.distributed.device import device_name
from hpctrain.plan.calibrate import local_cluster, measure_device, measure_gemm_shapes
from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.inputs import cluster_spec, layout_of, simulated_in_flight, step_shape
from hpctrain.plan.memory.formulas import ModelStates
from hpctrain.plan.memory.model import (
    engine_states,
    gathered_bytes,
    rank_memory,
    stage_activations,
)
from hpctrain.plan.time import step_time

log = logging.getLogger(__name__)
STATE_KEYS = (("params", "mem_params_bytes"), ("grads", "mem_grads_bytes"),
              ("optimizer", "mem_optim_bytes"))


def run_cluster(cfg: Config, *, device: torch.device | None = None) -> ClusterSpec:
    """The ClusterSpec for `cfg` (module docstring: calibration, accelerator, measured)."""
    c, t = cfg.cluster, cfg.train
    if c.accelerator is not None or c.calibration is not None:
        return cluster_spec(cfg)

    dev = device or torch.device("cpu")
    spec = measure_device(cfg.model, tokens=t.micro_batch_size * t.seq_len, tp=cfg.parallel.tp,
                          precision=t.precision, device=dev, name=device_name(dev))
    return local_cluster(spec, gpus_per_node=c.procs_per_node,
                         achievable_fraction=c.achievable_fraction)


def predicted_states(cfg: Config) -> ModelStates:
    """Model-state bytes on the busiest rank of `cfg`'s layout (`plan.rank_memory`)."""
    return engine_states(cfg.model, layout_of(cfg), step_shape(cfg))


def predicted_activations(cfg: Config) -> dict[str, float]:
    """Saved-for-backward bytes at the peak of a step on the first and the last pipeline stage
    (`plan.rank_memory`; the logging rank is a last stage)."""
    simulated_in_flight(cfg)  # the runtime's checks of the schedule, same messages
    return stage_activations(cfg.model, layout_of(cfg), step_shape(cfg))


def predicted_peak(cfg: Config) -> dict[str, float]:
    """Bytes on the busiest rank (`plan.rank_memory`, the model the layout search uses):
    model states, activations (the larger stage), buffers and their total; and the logging
    rank's states + activations (+ ZeRO-3's gathered units) for the run's comparison with its
    ledger."""
    layout = layout_of(cfg)
    simulated_in_flight(cfg)  # the runtime's checks of the schedule, same messages
    mem = rank_memory(cfg.model, layout, step_shape(cfg))
    states, acts = mem.params + mem.grads + mem.optimizer, predicted_activations(cfg)
    gathered = gathered_bytes(cfg.model, layout, step_shape(cfg))  # ZeRO-3's, in the ledger
    return {"states": states, "activations": mem.activations, "buffers": mem.buffers,
            "total": mem.total, "logging_rank_activations": acts["last"],
            "logging_rank_total": states + acts["last"] + gathered}


def predicted_step_time(cfg: Config, cluster: ClusterSpec):
    """`hpctrain.plan.time.step_time` for `cfg` on `cluster` (no dp overlap assumed), of
    the collectives hpctrain issues."""
    t = cfg.train
    return step_time(cfg.model, cluster, layout=layout_of(cfg), global_batch=t.global_batch_size,
                     micro_batch_size=t.micro_batch_size, seq_len=t.seq_len,
                     recompute=t.activation_checkpointing, precision=t.precision,
                     issued=step_shape(cfg),
                     # a device without FP8 units (CPU: emulated) times the GEMMs at its peak
                     fp8=t.fp8 and cluster.device.fp8_flops is not None)


def predict_run(cfg: Config, *, device: torch.device | None = None) -> dict[str, Any]:
    """predicted_* metrics for the run: step time, its compute part, the peak it assumed,
    model-state bytes (total and per category), the logging rank's activation bytes and
    peak (states + activations; `predicted_peak`); on a GPU also measured_gemm_flops, the
    model's GEMM shapes timed on it (`calibrate.measure_gemm_shapes`, for
    plan.calibrate_from). Failures are logged, never raised: a planner gap must not stop
    training."""
    try:
        states, peak = predicted_states(cfg), predicted_peak(cfg)
        cluster = run_cluster(cfg, device=device)
        st = predicted_step_time(cluster=cluster, cfg=cfg)
    except (ValueError, KeyError, RuntimeError) as e:
        log.warning("no prediction for this run (%s): the planner cannot model it", e)
        return {}
    out = {"predicted_step_time_s": st.step_time_s, "predicted_compute_s": st.compute_s,
           "predicted_peak_flops": cluster.device.peak_flops(cfg.train.precision),
           "predicted_device": cluster.device.name,
           "layout": f"{layout_of(cfg).describe()} {cfg.train.activation_checkpointing}",
           "parallel_auto": cfg.parallel.auto,
           "predicted_mem_model_state_bytes": int(states.total)}
    out.update({f"predicted_{key}": int(getattr(states, name)) for name, key in STATE_KEYS})
    out.update(predicted_mem_activation_bytes=int(peak["logging_rank_activations"]),
               predicted_mem_peak_bytes=int(peak["logging_rank_total"]))
    if device is not None and device.type == "cuda":  # per-kernel rates for calibrate_from
        out.update(_measured_gemms(cfg, device))
    return out


def _measured_gemms(cfg: Config, device: torch.device) -> dict[str, Any]:
    """{"measured_gemm_flops": [[precision, M, K, N, FLOP/s], ...]} of this rank's GEMM
    shapes, or {} (logged) when they cannot be timed."""
    t = cfg.train
    try:
        rows = measure_gemm_shapes(cfg.model, tokens=t.micro_batch_size * t.seq_len
                                   // cfg.parallel.cp, tp=cfg.parallel.tp,
                                   precision=t.precision, device=device)
    except (ValueError, KeyError, RuntimeError, AttributeError) as e:
        log.warning("GEMM shapes not timed (%s): plan.calibrate_from will use the roofline", e)
        return {}
    return {"measured_gemm_flops": [list(row) for row in rows]}


def compare(predicted: dict[str, Any], *, step_time_s: float | None,
            ledger: dict[str, int]) -> dict[str, Any]:
    """Measured next to predicted, and the ratios measured / predicted."""
    if not predicted:
        return {}
    measured_mem = sum(ledger.get(key, 0) for _, key in STATE_KEYS)
    out = {**predicted, "mem_model_state_bytes": measured_mem,
           "mem_activation_bytes": ledger.get("mem_activation_peak_bytes"),
           "mem_peak_bytes": ledger.get("mem_bytes"),
           "step_time_ratio": _ratio(step_time_s, predicted.get("predicted_step_time_s")),
           "mem_model_state_ratio": _ratio(measured_mem,
                                           predicted.get("predicted_mem_model_state_bytes")),
           "mem_activation_ratio": _ratio(ledger.get("mem_activation_peak_bytes"),
                                          predicted.get("predicted_mem_activation_bytes")),
           "mem_peak_ratio": _ratio(ledger.get("mem_bytes"),
                                    predicted.get("predicted_mem_peak_bytes"))}
    return out


def _ratio(measured, predicted) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


class RunPrediction:
    """The trainer's handle: computed once on the logging rank, logged once, compared last."""

    def __init__(self, cfg: Config, *, device: torch.device, logging_rank: bool):
        self.values = predict_run(cfg, device=device) if logging_rank else {}
        self._logged = False

    def once(self) -> dict[str, Any]:
        """The predicted_* values the first time (for the first metrics record), then {}."""
        if self._logged:
            return {}
        self._logged = True
        return self.values

    def summary(self, summary: dict[str, Any], ledger: dict[str, int]) -> dict[str, Any]:
        return compare(self.values, step_time_s=summary.get("step_time_s"), ledger=ledger)

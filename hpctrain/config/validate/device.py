"""Checks of what this machine's devices run: the device and backend asked for, the precision
they run fast, the attention backend's limits, and FP8's bf16 autocast. A job submitted from a
Slurm login node is checked again in each of its tasks, where its devices are."""

from __future__ import annotations

import logging
import os

from hpctrain.config.bench import bench_trains
from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.distributed.device import cuda_available, resolve_device_type
from hpctrain.ops.attention import backend_problem

log = logging.getLogger(__name__)


def on_login_node(c: Config) -> bool:
    """Submitting to Slurm from outside a job: the devices are elsewhere."""
    return c.cluster.launcher == "slurm" and "SLURM_PROCID" not in os.environ


@check("cluster.", "train.")
def check_device(c: Config) -> list[str]:
    if on_login_node(c):
        return []
    device = resolve_device_type(c.cluster.device)
    if device == "cuda" and not cuda_available():
        return ["cluster.device=cuda but no CUDA device is visible: use cluster.device=auto"]
    if c.cluster.backend == "nccl" and device != "cuda":
        return ["cluster.backend=nccl needs CUDA devices: use cluster.backend=auto (gloo on CPU)"]
    if c.train.precision == "fp16" and device == "cpu":
        if not c.train.allow_slow_precision:
            return ["train.precision=fp16 on CPU is ~100× slower than bf16: use "
                    "train.precision=bf16 or fp32 (or train.allow_slow_precision=true)"]
        log.warning("train.precision=fp16 on CPU: expect it to be very slow")
    return []


@check("model.attention", "cluster.", "train.precision")
def check_attention(c: Config) -> list[str]:
    """The backend's device, dtype and direction limits (ops.attention.backend_problem); a
    benchmark other than bench=train runs no backward."""
    if on_login_node(c):
        return []
    training = c.task != "bench" or bench_trains(c.extra)
    problem = backend_problem(c.model.attention, device_type=resolve_device_type(
        c.cluster.device), training=training, precision=c.train.precision)
    return [problem] if problem else []


@check("train.fp8", "train.precision")
def check_fp8(c: Config) -> list[str]:
    """FP8 linears scale bf16 activations and gradients into float8: they need bf16 autocast."""
    if c.train.fp8 and c.train.precision != "bf16":
        return [f"train.fp8=true runs the linears' GEMMs in float8 on top of bf16 autocast, but "
                f"train.precision={c.train.precision}: set train.precision=bf16, or "
                "train.fp8=false"]
    return []

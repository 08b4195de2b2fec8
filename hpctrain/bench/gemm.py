"""`bench=gemm`: matmul throughput per device, for the model's projections and a square sweep.

Y_MN = X_MK · W_KN costs 2·M·K·N FLOPs. The model shapes are the per-device projections of one
micro-batch (M = micro_batch_size × seq_len tokens), with Megatron's tensor-parallel split:
column-parallel layers (qkv, mlp_up, output) divide N by tp, row-parallel ones (o, mlp_down)
divide K. Each result is compared with the device's dense peak for that precision from
hpctrain.metrics.devices, the table MFU uses; the fraction is null for a device not in the table
(any CPU) rather than a number against a guessed peak.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hpctrain.bench.timing import TORCH_DTYPES, node_name, slow_factor_for, stem, timed
from hpctrain.config.bench import BenchConfig, default_precisions
from hpctrain.config.schema import Config
from hpctrain.distributed.device import device_name
from hpctrain.distributed.mesh import Mesh
from hpctrain.metrics.devices import lookup_device
from hpctrain.models.config import ModelConfig

Shape = tuple[str, str, int, int, int]  # (kind, name, M, K, N)


def model_shapes(model: ModelConfig, *, tokens: int, tp: int) -> list[Shape]:
    """The matmuls of one transformer block and the output head, as one tp rank runs them."""
    d, f, v = model.dim, model.ffn_dim, model.vocab_size
    qkv = d + 2 * model.n_kv_heads * model.head_dim
    return [("model", "qkv", tokens, d, max(1, qkv // tp)),
            ("model", "o", tokens, max(1, d // tp), d),
            ("model", "mlp_up", tokens, d, max(1, f // tp)),  # w1 and w3 each
            ("model", "mlp_down", tokens, max(1, f // tp), d),
            ("model", "output", tokens, d, max(1, v // tp))]


def square_shapes(b: BenchConfig) -> list[Shape]:
    out, n = [], b.gemm_min_dim
    while n <= b.gemm_max_dim:
        out.append(("square", f"{n}^3", n, n, n))
        n *= 2
    return out


def peak_flops(name: str, precision: str) -> float | None:
    spec = lookup_device(name)
    if spec is None:
        return None
    try:
        return spec.peak_flops(precision)
    except ValueError:
        return None


@contextlib.contextmanager
def _matmul_precision(precision: str):
    """tf32 is fp32 storage with TF32 tensor-core matmuls; every other precision is exact."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _measure(shape: Shape, precision: str, b: BenchConfig, mesh: Mesh, slow: float) -> dict:
    kind, name, m, k, n = shape
    dtype, dev = TORCH_DTYPES[precision], mesh.device
    x, w = torch.randn(m, k, dtype=dtype, device=dev), torch.randn(k, n, dtype=dtype, device=dev)
    y = torch.empty(m, n, dtype=dtype, device=dev)
    with _matmul_precision(precision):
        seconds = timed(lambda: torch.matmul(x, w, out=y), iters=b.iters, warmup=b.warmup,
                        device=dev, slow_factor=slow)
    flops = 2 * m * k * n / seconds
    peak = peak_flops(device_name(dev), precision)
    return {"kind": kind, "shape": name, "m": m, "k": k, "n": n, "precision": precision,
            "time_s": seconds, "tflops": flops / 1e12,
            "peak_tflops": None if peak is None else peak / 1e12,
            "fraction_of_peak": None if peak is None else flops / peak}


def run_gemm(b: BenchConfig, mesh: Mesh, cfg: Config) -> list[dict[str, Any]]:
    """Every shape × precision on this rank's device (no communication)."""
    node = node_name()
    slow = slow_factor_for(b, rank=mesh.rank, node=node)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    shapes = model_shapes(cfg.model, tokens=tokens, tp=cfg.parallel.tp) + square_shapes(b)
    precisions = b.precisions or default_precisions(mesh.device.type)
    device = device_name(mesh.device)
    return [stem("gemm", rank=mesh.rank, node=node, device=device, model=cfg.model.name,
                 **_measure(shape, p, b, mesh, slow))
            for p in precisions for shape in shapes]

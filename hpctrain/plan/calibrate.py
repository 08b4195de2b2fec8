"""Calibrate the planner's hardware numbers by measurement instead of a datasheet.

Two sources:

- `measure_device`: a short GEMM on this process's device, run once per training run on the
  logging rank when `cluster.accelerator` is not set (a CPU, an unknown GPU). The model's
  largest per-rank projection (M = micro_batch_size·seq_len tokens, Megatron's tp split, see
  `hpctrain.bench.gemm.model_shapes`) is timed in the training precision for ≈ 0.2 s. The
  returned DeviceSpec's "peak" for that precision is then the *measured* GEMM throughput, not
  a datasheet peak, and `achievable_fraction` still applies on top of it (compute time =
  FLOPs / (measured · achievable_fraction)). Other precisions are NaN: not measured.
- `calibrated_cluster`: the records of a `task=bench` run (bench.json, see
  `hpctrain.bench.report`). Device peak per precision = the highest GEMM throughput measured
  (median over ranks per shape, max over shapes). Links: the median busbw of all_reduce at the
  largest message size, over groups inside one node (intra_node_bw) and over groups spanning
  nodes (inter_node_bw: a ring crossing nodes at tp=1 runs at the node's NIC rate, the
  planner's inter_node_bw); without all_reduce records, the median p2p bandwidth of same-node
  and cross-node pairs; latencies from the p2p half round trips. Whatever a file does not
  measure keeps the value of `base`.

- `measure_gemm_shapes`: on a GPU, each of the model's GEMM shapes (per tp rank) timed once at
  the start of a training run and logged with its prediction; `plan.calibrate_from` then
  times those shapes at their measured rate instead of the roofline's
  (`hpctrain.plan.calibrate_run`).

Without any measured link (single-node CPU runs), links use LOCAL_BW and LOCAL_LATENCY: the
order of magnitude of gloo over loopback on one machine (a bench=comm run on these CPUs gives
~1 GB/s busbw at 16 MiB and tens of µs per small message). Pass a bench file for better ones.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from hpctrain.bench.gemm import model_shapes
from hpctrain.bench.summary import gemm_rows
from hpctrain.bench.timing import TORCH_DTYPES
from hpctrain.distributed.device import synchronize
from hpctrain.metrics.devices import DeviceSpec
from hpctrain.plan.cluster import ClusterSpec

LOCAL_BW = 1e9  # bytes/s, gloo on one machine
LOCAL_LATENCY = 50e-6  # seconds per message
MEASURE_SECONDS = 0.2
SHAPE_SECONDS = 0.05  # per shape of `measure_gemm_shapes` (5 shapes: ~0.3 s at start-up)
_FIELDS = {"bf16": "bf16_flops", "fp16": "fp16_flops", "tf32": "tf32_flops",
           "fp32": "fp32_flops"}


def measured_spec(name: str, peaks: dict[str, float], *, memory_bytes: int = 0,
                  base: DeviceSpec | None = None) -> DeviceSpec:
    """A DeviceSpec whose peaks are `peaks` (precision → FLOP/s); others from `base`, or NaN."""
    values = {f: (getattr(base, f) if base else math.nan) for f in _FIELDS.values()}
    values.update({_FIELDS[p]: v for p, v in peaks.items() if p in _FIELDS})
    memory = base.memory_bytes if base else memory_bytes
    hbm = base.hbm_bandwidth if base else math.nan
    return DeviceSpec(name=name, memory_bytes=memory, hbm_bandwidth=hbm, **values)


_measured: dict[tuple, float] = {}  # a process times each GEMM once (0.2 s per trainer)


def gemm_flops(m: int, k: int, n: int, *, precision: str, device: torch.device,
               seconds: float = MEASURE_SECONDS) -> float:
    """FLOP/s of X_MK·W_KN in `precision` on `device`, timed for about `seconds` (once per
    process: a later call with the same arguments returns that measurement)."""
    key = (m, k, n, precision, str(device), seconds)
    if key not in _measured:
        _measured[key] = _time_gemm(m, k, n, precision=precision, device=device,
                                    seconds=seconds)
    return _measured[key]


def _time_gemm(m: int, k: int, n: int, *, precision: str, device: torch.device,
               seconds: float) -> float:
    dtype = TORCH_DTYPES[precision]
    x, w = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype,
                                                                      device=device)
    y = torch.empty(m, n, dtype=dtype, device=device)
    torch.matmul(x, w, out=y)  # warm-up
    synchronize(device)
    iters, elapsed = 0, 0.0
    t0 = time.perf_counter()
    while elapsed < seconds or iters < 3:
        torch.matmul(x, w, out=y)
        iters += 1
        if iters in (1, 2, 4) or iters % 8 == 0:
            synchronize(device)
            elapsed = time.perf_counter() - t0
    synchronize(device)
    return 2 * m * k * n * iters / (time.perf_counter() - t0)


def measure_device(model, *, tokens: int, tp: int, precision: str, device: torch.device,
                   name: str, seconds: float = MEASURE_SECONDS) -> DeviceSpec:
    """DeviceSpec with the measured GEMM throughput of the model's largest projection."""
    _, _, m, k, n = max(model_shapes(model, tokens=tokens, tp=tp),
                        key=lambda s: s[2] * s[3] * s[4])
    flops = gemm_flops(m, k, n, precision=precision, device=device, seconds=seconds)
    return measured_spec(f"{name} (measured {m}x{k}x{n} {precision} GEMM)", {precision: flops})


def measure_gemm_shapes(model, *, tokens: int, tp: int, precision: str, device: torch.device,
                        seconds: float = SHAPE_SECONDS) -> tuple[tuple, ...]:
    """(precision, M, K, N, FLOP/s) of each distinct projection and output-head GEMM of one
    tp rank (`hpctrain.bench.gemm.model_shapes`), each timed for about `seconds`: what a GPU
    run logs so that plan.calibrate_from can time those shapes as measured
    (ClusterSpec.gemm_flops)."""
    shapes = sorted({s[2:] for s in model_shapes(model, tokens=tokens, tp=tp)})
    return tuple((precision, m, k, n, gemm_flops(m, k, n, precision=precision, device=device,
                                                 seconds=seconds)) for m, k, n in shapes)


def local_cluster(device: DeviceSpec, *, gpus_per_node: int,
                  achievable_fraction: float) -> ClusterSpec:
    """One machine whose links are the LOCAL_* constants (module docstring)."""
    return ClusterSpec(device=device, gpus_per_node=gpus_per_node, intra_node_bw=LOCAL_BW,
                       inter_node_bw=LOCAL_BW, latency_intra=LOCAL_LATENCY,
                       latency_inter=LOCAL_LATENCY, achievable_fraction=achievable_fraction)


def _gemm_peaks(records: list[dict]) -> dict[str, float]:
    """precision → max over shapes of the median-over-ranks GEMM FLOP/s."""
    peaks: dict[str, float] = {}
    for row in gemm_rows(records):
        flops = row["median_tflops"] * 1e12
        peaks[row["precision"]] = max(peaks.get(row["precision"], 0.0), flops)
    return peaks


def _link_bws(records: list[dict]) -> tuple[float | None, float | None]:
    """(intra, inter) bytes/s: median all_reduce busbw at the largest size, split by whether
    the group stays in one node; falls back to same-/cross-node p2p bandwidth."""
    ar = [r for r in records if r.get("bench") == "comm" and r.get("supported", True)
          and r.get("collective") == "all_reduce"]
    node_of = {r["rank"]: r["node"] for r in records if "rank" in r and "node" in r}
    intra, inter = [], []
    if ar:
        largest = max(r["bytes"] for r in ar)
        for r in ar:
            if r["bytes"] == largest:
                nodes = {node_of.get(x, r["node"]) for x in r["group_ranks"]}
                (inter if len(nodes) > 1 else intra).append(r["busbw_GBps"] * 1e9)
    p2p = [r for r in records if r.get("bench") == "p2p"]
    if not intra:
        intra = [r["bw_GBps"] * 1e9 for r in p2p if r["src_node"] == r["dst_node"]]
    if not inter:
        inter = [r["bw_GBps"] * 1e9 for r in p2p if r["src_node"] != r["dst_node"]]
    return (statistics.median(intra) if intra else None,
            statistics.median(inter) if inter else None)


def _latencies(records: list[dict]) -> tuple[float | None, float | None]:
    p2p = [r for r in records if r.get("bench") == "p2p"]
    same = [r["latency_s"] for r in p2p if r["src_node"] == r["dst_node"]]
    cross = [r["latency_s"] for r in p2p if r["src_node"] != r["dst_node"]]
    return (statistics.median(same) if same else None,
            statistics.median(cross) if cross else None)


def load_bench(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "bench.json"
    if not p.is_file():
        raise ValueError(f"cluster.calibration={str(path)!r}: no bench.json there; run "
                         "`python -m hpctrain task=bench bench=gemm` (or comm, p2p) and pass "
                         "its run directory or bench.json")
    doc = json.loads(p.read_text())
    if not isinstance(doc, dict) or "records" not in doc:
        raise ValueError(f"{p} is not a task=bench output (no 'records'): pass a bench.json")
    return doc


def calibrated_cluster(path: str | Path, *, base: ClusterSpec | None = None) -> ClusterSpec:
    """`base` (default: a measured-device local cluster) with what `path` measured (module
    docstring). gpus_per_node = world_size / nodes of the bench run when `base` is None."""
    doc = load_bench(path)
    records, meta = doc["records"], doc.get("meta", {})
    peaks = _gemm_peaks(records)
    if base is None:
        name = next((r["device"] for r in records if r.get("device")), "bench device")
        device = measured_spec(f"{name} (bench GEMM)", peaks)
        per_node = max(1, meta.get("world_size", 1) // max(1, len(meta.get("nodes", [])) or 1))
        base = local_cluster(device, gpus_per_node=per_node, achievable_fraction=0.5)
    elif peaks:
        base = replace(base, device=measured_spec(f"{base.device.name} (bench GEMM)", peaks,
                                                  base=base.device))
    intra, inter = _link_bws(records)
    lat_intra, lat_inter = _latencies(records)
    changes = {k: v for k, v in dict(intra_node_bw=intra, inter_node_bw=inter,
                                     latency_intra=lat_intra, latency_inter=lat_inter).items()
               if v is not None and v > 0}
    if intra or inter:  # bus bandwidths as NCCL reached them: no datasheet share on top
        changes["links"] = "measured"
    return replace(base, **changes)

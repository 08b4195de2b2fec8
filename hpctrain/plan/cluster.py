"""ClusterSpec: the few numbers of a GPU cluster the analytical planner needs.

Bandwidths are unidirectional bytes/s. `intra_node_bw` is per GPU (what one GPU can push into
the NVLink/NVSwitch fabric); `inter_node_bw` is per node (NICs × per-NIC rate), shared by the
GPUs of that node. Collective costs built on them live in `hpctrain.plan.time`.

Datasheet links (`links="datasheet"`, the default) are scaled by the share NCCL reaches of
them (`hpctrain.plan.hardware`: nvlink, nic) in `intra_bw`/`inter_bw`; measured links
(`links="measured"`: a bench.json's bus bandwidths, `hpctrain.plan.calibrate`) are used as
they are. Without `achievable_fraction` the device generation's GEMM share is used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from hpctrain.metrics.devices import DEVICES, DeviceSpec
from hpctrain.plan.hardware import kernel_constants

# Fraction of the dense peak that well-shaped bf16/fp16 GEMMs sustain inside a training step,
# for devices outside the generation table (hpctrain.plan.hardware, which has A100 0.7 and
# H100/H200 0.5). Only the GEMM roofline uses it directly: elementwise kernels, the attention
# core and communication are modelled separately (hpctrain.plan.kernels, hpctrain.plan.time).
DEFAULT_ACHIEVABLE_FRACTION = 0.7


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: one device type, `gpus_per_node` per node.

    achievable_fraction: the fraction of `device`'s dense peak that GEMMs reach; compute
    time is FLOPs / (peak · achievable_fraction); None takes the device generation's share
    (`hpctrain.plan.hardware`). links: "datasheet" rates are scaled by NCCL's share of them
    (`intra_bw`, `inter_bw`), "measured" ones (a bench.json) are not. Latencies are per
    message, in seconds.
    """

    device: DeviceSpec
    gpus_per_node: int
    intra_node_bw: float
    inter_node_bw: float
    latency_intra: float = 5e-6
    latency_inter: float = 10e-6
    achievable_fraction: float | None = None  # None: the generation's GEMM share
    links: Literal["datasheet", "measured"] = "datasheet"
    # GEMMs timed on this device (a training run's log, plan.calibrate_from): (precision, M,
    # K, N, standalone FLOP/s); those shapes run at that rate · gemm/mamf (plan.kernels)
    gemm_flops: tuple[tuple[str, int, int, int, float], ...] = ()

    def measured_gemms(self, precision: str) -> tuple[tuple[int, int, int, float], ...]:
        """The (M, K, N, FLOP/s) of `gemm_flops` timed in `precision`."""
        return tuple(row[1:] for row in self.gemm_flops if row[0] == precision)

    def __post_init__(self) -> None:
        if self.achievable_fraction is None:
            object.__setattr__(self, "achievable_fraction", kernel_constants(self.device).gemm)
        if self.links not in ("datasheet", "measured"):
            raise ValueError(f"links={self.links!r} must be 'datasheet' or 'measured'")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} must be >= 1")
        if self.intra_node_bw <= 0 or self.inter_node_bw <= 0:
            raise ValueError(
                f"bandwidths must be positive (intra_node_bw={self.intra_node_bw}, "
                f"inter_node_bw={self.inter_node_bw}); give bytes/s, e.g. 300e9"
            )
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError(
                f"achievable_fraction={self.achievable_fraction} must be in (0, 1]; "
                f"{DEFAULT_ACHIEVABLE_FRACTION} is a reasonable default"
            )

    def with_(self, **changes) -> ClusterSpec:
        return replace(self, **changes)

    @property
    def intra_bw(self) -> float:
        """Bytes/s a collective reaches per GPU on NVLink (datasheet × the NCCL share)."""
        share = kernel_constants(self.device).nvlink if self.links == "datasheet" else 1.0
        return self.intra_node_bw * share

    @property
    def inter_bw(self) -> float:
        """Bytes/s a collective reaches per node over the NICs (datasheet × the NCCL share)."""
        share = kernel_constants(self.device).nic if self.links == "datasheet" else 1.0
        return self.inter_node_bw * share


def megatron_a100_cluster() -> ClusterSpec:
    """The cluster of Narayanan et al. 2021 (Selene-like DGX A100 nodes).

    8 × A100 80GB per node; NVLink 3 at 300 GB/s per direction per GPU (12 links × 25 GB/s);
    8 × 200 Gb/s HDR InfiniBand per node = 8 × 25 GB/s = 200 GB/s per node.
    """
    return ClusterSpec(
        device=DEVICES["A100-80GB"],
        gpus_per_node=8,
        intra_node_bw=300e9,
        inter_node_bw=8 * 200e9 / 8,
    )


def dgx_h100_cluster(device: str = "H100-SXM") -> ClusterSpec:
    """DGX H100 / HGX H200 nodes (the Megatron-LM README's H100 runs): 8 GPUs per node,
    NVLink 4 at 450 GB/s per direction per GPU (18 links × 25 GB/s), 8 × 400 Gb/s NDR
    InfiniBand per node = 400 GB/s per node."""
    return ClusterSpec(device=DEVICES[device], gpus_per_node=8, intra_node_bw=450e9,
                       inter_node_bw=8 * 400e9 / 8)


CLUSTERS = {"megatron_a100": megatron_a100_cluster, "dgx_h100": dgx_h100_cluster}

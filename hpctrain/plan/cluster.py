"""ClusterSpec: the few numbers of a GPU cluster the analytical planner needs.

Bandwidths are unidirectional bytes/s. `intra_node_bw` is per GPU (what one GPU can push into
the NVLink/NVSwitch fabric); `inter_node_bw` is per node (NICs × per-NIC rate), shared by the
GPUs of that node. Collective costs built on them live in `hpctrain.plan.time`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain.metrics.devices import DEVICES, DeviceSpec

# Fraction of the dense peak that well-shaped bf16/fp16 GEMMs sustain inside a training step
# (cuBLAS on an A100 reaches 70–80% of 312 TFLOP/s on large GEMMs). Only the GEMM roofline
# uses it: elementwise kernels, the attention core's shape and communication are modelled
# separately (hpctrain.plan.kernels, hpctrain.plan.time), which is how one value meets every
# row of Megatron-LM 2021 Table 1 (tests/unit/test_plan_time.py).
DEFAULT_ACHIEVABLE_FRACTION = 0.7


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: one device type, `gpus_per_node` per node.

    achievable_fraction: the fraction of `device`'s dense peak that compute reaches; compute
    time is FLOPs / (peak · achievable_fraction). Latencies are per message, in seconds.
    """

    device: DeviceSpec
    gpus_per_node: int
    intra_node_bw: float
    inter_node_bw: float
    latency_intra: float = 5e-6
    latency_inter: float = 10e-6
    achievable_fraction: float = DEFAULT_ACHIEVABLE_FRACTION

    def __post_init__(self) -> None:
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


CLUSTERS = {"megatron_a100": megatron_a100_cluster}

"""Per-generation kernel constants: what a device's kernels reach of its datasheet, chosen once.

The datasheet (`hpctrain.metrics.devices`) gives peaks and HBM bandwidth; the time model
(`hpctrain.plan.kernels`, `hpctrain.plan.time`) needs the share of them that real kernels
sustain inside a training step. One row per GPU generation, every field inside the range a
published kernel benchmark gives; no per-table or per-row factor. Where the point inside a
range was picked while looking at a published training table, the entry says so (the GEMM
shares: A100's against Megatron-LM 2021 Table 1 in issue 17, H100's against the README's H100
table here), and tests/unit/test_plan_published.py pins the rows so a refit is visible:

  gemm          share of the dense bf16 peak a training step's GEMMs sustain (in step:
                clocks under a node's sustained power draw, GEMMs beside communication
                kernels, training shapes); ClusterSpec.achievable_fraction when not given.
  mamf          the best standalone bf16 GEMM of a shape sweep, as a share of the peak
                (Bekman, "Maximum Achievable Matmul FLOPS", ml-engineering: A100 SXM ~87%,
                H100 SXM ~80%). gemm / mamf is what a step keeps of a standalone benchmark;
                the attention shares below are scaled by it.
                A100: 0.7 (cuBLAS 70–80% of 312 TFLOP/s on Megatron's shapes; the value the
                planner has used since issue 17, chosen on a 0.7–0.85 grid over Table 1).
                H100/H200: standalone cuBLAS at 8192³ is measured from 518 TFLOP/s
                (pranjalssh/fast.cu issue 13, CUDA 12.4) to ~720 (the fast.cu worklog),
                0.52–0.73 of 989, below the 0.80 sweep maximum; times the A100's
                in-step/standalone ratio (0.7/0.87 = 0.8): 0.42–0.64. 0.5 is in that range;
                it was chosen after seeing the visible H100 rows (0.45: −8, −4, −16%; 0.55:
                +8, +14, +2%; 0.5: 0, +4, −7%), so it is the least independent constant
                here: calibrate it from a run of yours (plan.calibrate_from).
  attn_fwd/bwd  standalone share of the dense peak a fused (flash) attention kernel reaches,
                FLOPs counted as its benchmarks count them: forward 4·s·k·d per head,
                backward 2.5× that (5 matmuls, P recomputed), causal tiles above the diagonal
                skipped. A100: FlashAttention-2 (Dao 2023, Fig. 5–6: head dim 128, causal,
                2k–4k: ~190 TFLOP/s forward, ~160 backward). H100: FlashAttention-3 / cuDNN
                (Shah et al. 2024, Fig. 5–7: causal head dim 128 at 4k: ~600 forward, ~450
                backward).
  hbm           share of the HBM datasheet rate streaming kernels reach (STREAM-like copies:
                ~1.6 of 2.0 TB/s on an A100, ~2.6–2.9 of 3.35 on an H100 SXM).
  nvlink        NCCL all-reduce bus bandwidth / NVLink datasheet rate inside one node
                (nccl-tests on DGX A100: ~230–240 of 300 GB/s; DGX H100: ~360 of 450 GB/s
                without NVLink SHARP).
  nic           the same for the InfiniBand NICs (HDR 200 Gb/s and NDR 400 Gb/s reach ~92%
                of the line rate in ib_write_bw / nccl-tests across nodes).

H200 is the H100's GH100 die with HBM3e (4.8 TB/s): the same kernels, the same shares.
Devices outside the table (a CPU, an unknown GPU, a measured device) get `GENERIC`: the
previous single-constant model (0.7 of peak for every kernel, HBM at 0.8, links as given).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConstants:
    """Shares of the datasheet one generation's kernels reach (module docstring)."""

    generation: str
    gemm: float
    mamf: float
    attn_fwd: float
    attn_bwd: float
    hbm: float
    nvlink: float
    nic: float

    def __post_init__(self) -> None:
        for name in ("gemm", "mamf", "attn_fwd", "attn_bwd", "hbm", "nvlink", "nic"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"KernelConstants({self.generation}).{name}={value} must be "
                                 "in (0, 1]: it is a share of a datasheet rate")
        if self.gemm > self.mamf:
            raise ValueError(f"KernelConstants({self.generation}).gemm={self.gemm} exceeds "
                             f"mamf={self.mamf}: a training step cannot beat the best "
                             "standalone GEMM")

    @property
    def in_step(self) -> float:
        """What a training step keeps of a standalone kernel benchmark: gemm / mamf."""
        return self.gemm / self.mamf


GENERIC = KernelConstants("generic", gemm=0.7, mamf=0.7, attn_fwd=0.7, attn_bwd=0.7,
                          hbm=0.8, nvlink=1.0, nic=1.0)
KERNELS: dict[str, KernelConstants] = {
    k.generation: k for k in (
        KernelConstants("A100", gemm=0.7, mamf=0.87, attn_fwd=0.6, attn_bwd=0.5, hbm=0.8,
                        nvlink=0.78, nic=0.92),
        KernelConstants("H100", gemm=0.5, mamf=0.8, attn_fwd=0.6, attn_bwd=0.45, hbm=0.8,
                        nvlink=0.8, nic=0.92),
        KernelConstants("H200", gemm=0.5, mamf=0.8, attn_fwd=0.6, attn_bwd=0.45, hbm=0.8,
                        nvlink=0.8, nic=0.92),
    )
}
# Device table rows (hpctrain.metrics.devices) of each generation.
GENERATION_OF = {"A100-40GB": "A100", "A100-80GB": "A100", "H100-SXM": "H100",
                 "H100-PCIe": "H100", "H100-NVL": "H100", "H200": "H200", "H200-NVL": "H200",
                 "GH200-96GB": "H100", "GH200-144GB": "H200"}


def kernel_constants(device) -> KernelConstants:
    """The row of `device`'s generation (by its device-table name, also when a calibration
    suffixed it: "H100-SXM (bench GEMM)"), else GENERIC."""
    name = str(getattr(device, "name", "")).split(" (")[0]
    generation = GENERATION_OF.get(name)
    return KERNELS[generation] if generation else GENERIC

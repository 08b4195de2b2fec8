"""Accelerator table: dense peak FLOP/s, memory and HBM bandwidth, looked up by torch's name.

The MFU denominator (metrics.throughput) and the hardware the planner and benchmarks assume;
it sits in metrics, below train, bench and plan, so all of them read one table.

Peaks are the vendors' *dense* (no 2:4 sparsity) tensor-core numbers. Memory is in bytes; the
vendors' "80GB"/"141GB" are binary gigabytes on these parts (nvidia-smi shows 81920 MiB for an
A100 80GB), so the table stores GiB × 2^30. An MI250X appears to torch as two devices (one per
GCD), so its row is one GCD: half the package's peak and memory.

`lookup_device` never guesses: a name it cannot pin to one row returns None, and callers then
report MFU as null rather than a number computed against the wrong peak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TFLOP = 1e12
GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the planner sees it. FLOP/s are dense peaks; None where not published."""

    name: str
    bf16_flops: float
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    fp16_flops: float | None = None
    tf32_flops: float | None = None
    fp32_flops: float | None = None
    fp8_flops: float | None = None  # E4M3/E5M2 tensor cores; None: the part has none

    def peak_flops(self, precision: str) -> float:
        """Dense peak for `precision` ('bf16', 'fp16', 'tf32', 'fp32', 'fp8')."""
        value = {
            "fp8": self.fp8_flops,
            "bf16": self.bf16_flops,
            "fp16": self.fp16_flops,
            "tf32": self.tf32_flops,
            "fp32": self.fp32_flops,
        }.get(precision)
        if value is None or value != value:  # None: not published; NaN: not measured
            raise ValueError(
                f"no published {precision!r} peak for {self.name}: use precision='bf16' "
                "or pass a DeviceSpec with that peak filled in"
            )
        return value


def _spec(name, bf16, mem_gib, hbm_tbs, *, fp16=None, tf32=None, fp32=None,
          fp8=None) -> DeviceSpec:
    t = TFLOP
    return DeviceSpec(
        name=name,
        bf16_flops=bf16 * t,
        memory_bytes=int(mem_gib * GIB),
        hbm_bandwidth=hbm_tbs * 1e12,
        fp16_flops=None if fp16 is None else fp16 * t,
        tf32_flops=None if tf32 is None else tf32 * t,
        fp32_flops=None if fp32 is None else fp32 * t,
        fp8_flops=None if fp8 is None else fp8 * t,
    )


# FP8 dense peaks are half the datasheets' "with sparsity" figures: H100 SXM / H200 SXM /
# GH200 3,958 TFLOPS → 1979 (2× their bf16 989); H100 PCIe 3,026 → 1513; H100 NVL and
# H200 NVL 3,341 → 1670.5; B200 (HGX B200, per GPU) 9 PFLOPS → 4500; L40S 1,466 → 733;
# MI300X 2,614.9 dense (AMD's datasheet). A100 and MI250X have no FP8 units.
DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        _spec("A100-40GB", 312, 40, 1.555, fp16=312, tf32=156, fp32=19.5),
        _spec("A100-80GB", 312, 80, 2.039, fp16=312, tf32=156, fp32=19.5),
        _spec("H100-SXM", 989, 80, 3.35, fp16=989, tf32=494.5, fp32=66.9, fp8=1979),
        _spec("H100-PCIe", 756, 80, 2.0, fp16=756, tf32=378, fp32=51.2, fp8=1513),
        _spec("H100-NVL", 835, 94, 3.9, fp16=835, tf32=417.5, fp32=60, fp8=1670.5),
        _spec("H200", 989, 141, 4.8, fp16=989, tf32=494.5, fp32=66.9, fp8=1979),
        _spec("H200-NVL", 835, 141, 4.8, fp16=835, tf32=417.5, fp32=60, fp8=1670.5),
        _spec("GH200-96GB", 989, 96, 4.0, fp16=989, tf32=494.5, fp32=66.9, fp8=1979),
        _spec("GH200-144GB", 989, 144, 4.9, fp16=989, tf32=494.5, fp32=66.9,
              fp8=1979),
        _spec("B200", 2250, 180, 8.0, fp16=2250, tf32=1100, fp8=4500),
        _spec("L40S", 362, 48, 0.864, fp16=362, tf32=183, fp32=91.6, fp8=733),
        _spec("MI250X-GCD", 191.5, 64, 1.6384, fp16=191.5, fp32=47.9),
        _spec("MI300X", 1307.4, 192, 5.3, fp16=1307.4, tf32=653.7, fp32=163.4,
              fp8=2614.9),
    )
}

# (pattern on the normalised name, table key); first match wins, so specific before general.
# Patterns use word boundaries so "GH200" is not an H200 and "GB200" is not a B200.
_RULES: tuple[tuple[str, str], ...] = (
    (r"\bGH200\b.*\b144G", "GH200-144GB"),
    (r"\bGH200\b", "GH200-96GB"),
    (r"\bH200\b.*\bNVL\b", "H200-NVL"),
    (r"\bH200\b", "H200"),
    (r"\bH100\b.*\bNVL\b", "H100-NVL"),
    (r"\bH100\b.*\bPCIE\b", "H100-PCIe"),
    (r"\bH100\b.*\b(SXM\w*|HBM3)\b", "H100-SXM"),
    (r"\bA100\b.*\b80GB\b", "A100-80GB"),
    (r"\bA100\b.*\b40GB\b", "A100-40GB"),
    (r"\bB200\b", "B200"),
    (r"\bL40S\b", "L40S"),
    (r"\bMI250X\b", "MI250X-GCD"),
    (r"\bMI300X\b", "MI300X"),
)


def _normalise(name: str) -> str:
    """Upper-case with '-', '_' and '/' turned into spaces: 'A100-SXM4-80GB' → 'A100 SXM4 80GB'."""
    return " ".join(re.sub(r"[-_/]", " ", name.upper()).split())


def lookup_device(name: str) -> DeviceSpec | None:
    """The table row for a torch device name ("NVIDIA H100 80GB HBM3"), or a table key.

    Returns None when the name does not identify exactly one row (an unknown part, or an
    ambiguous one such as a bare "NVIDIA A100" whose memory size is not in the name).
    """
    if name in DEVICES:
        return DEVICES[name]
    norm = _normalise(name)
    for pattern, key in _RULES:
        if re.search(pattern, norm):
            return DEVICES[key]
    return None


def mfu_or_none(model_flops_per_s: float, device_name: str, *, precision: str = "bf16"):
    """Model FLOP/s per device ÷ the device's dense peak, or None if the device is unknown
    (or has no published peak for `precision`): an MFU against a guessed peak is worse than none.
    """
    spec = lookup_device(device_name)
    if spec is None:
        return None
    try:
        return model_flops_per_s / spec.peak_flops(precision)
    except ValueError:
        return None

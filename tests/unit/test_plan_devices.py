"""Device table lookup from torch device names."""

import pytest

from hpctrain.metrics.devices import DEVICES, lookup_device


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200-NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA GH200 480GB", "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", "GH200-144GB"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA L40S", "L40S"),
        ("AMD Instinct MI250X", "MI250X-GCD"),
        ("AMD Instinct MI300X", "MI300X"),
        ("H200", "H200"),  # a table key is accepted as is
    ],
)
def test_lookup_known_names(name, key):
    assert lookup_device(name) is DEVICES[key]


@pytest.mark.parametrize(
    "name",
    ["NVIDIA GB200", "NVIDIA L40", "NVIDIA A100", "NVIDIA H100", "AMD Instinct MI300A",
     "Tesla V100-SXM2-16GB", "cpu", ""],
)
def test_unknown_or_ambiguous_is_none(name):
    assert lookup_device(name) is None


def test_peaks_in_the_table():
    assert DEVICES["A100-80GB"].peak_flops("bf16") == 312e12
    assert DEVICES["H100-SXM"].bf16_flops == 989e12
    assert DEVICES["H100-PCIe"].bf16_flops == 756e12
    assert DEVICES["B200"].bf16_flops == 2250e12
    assert DEVICES["MI300X"].bf16_flops == pytest.approx(1307.4e12)
    assert DEVICES["H200"].memory_bytes == 141 * 2**30


def test_missing_precision_peak_names_the_fix():
    with pytest.raises(ValueError, match="no published 'fp32' peak for B200"):
        DEVICES["B200"].peak_flops("fp32")


def test_mfu_is_null_for_unknown_devices():
    from hpctrain.metrics.devices import mfu_or_none

    assert mfu_or_none(156e12, "NVIDIA A100-SXM4-80GB") == pytest.approx(0.5)
    assert mfu_or_none(156e12, "Some Future GPU") is None
    assert mfu_or_none(1e12, "NVIDIA B200", precision="fp32") is None

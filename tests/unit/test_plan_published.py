"""The time model against every visible published row, one set of constants per device
generation (hpctrain.plan.hardware), unstated settings searched (hpctrain.plan.published)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpctrain.plan import hardware
from hpctrain.plan.hardware import KERNELS, KernelConstants
from hpctrain.plan.published import SOURCES, predict_row

# (source, reference file) of every visible table
TABLES = [("megatron_table1", "megatron_table1.csv"),
          ("korthikanti_full", "korthikanti2022_visible.csv"),
          ("korthikanti_selective", "korthikanti2022_visible.csv"),
          ("megatron_h100", "megatron_h100_visible.csv")]
A100_TABLES = TABLES[:3]
H100_TABLES = TABLES[3:]


def _predictions(reference, tables):
    return {(name, i): predict_row(name, row)
            for name, path in tables for i, row in enumerate(reference(path))}


@pytest.mark.parametrize(("name", "path"), TABLES)
def test_every_visible_row_within_10_percent(reference, name, path):
    for row in reference(path):
        p = predict_row(name, row)
        assert abs(p.error) <= 0.10, (name, row, p.predicted, p.published, p.assumed.describe())


def test_every_prediction_says_what_it_assumed(reference):
    p = predict_row("megatron_h100", reference("megatron_h100_visible.csv")[1])  # 70B
    text = p.assumed.describe()
    for part in ("mbs ", "recompute ", " v", "overlap tp+dp+pp", "fp32 grad reduce"):
        assert part in text
    assert p.assumed.micro_batch_size in SOURCES["megatron_h100"].allowed.micro_batch_sizes
    stated = predict_row("korthikanti_full", reference("korthikanti2022_visible.csv")[0])
    assert stated.assumed.micro_batch_size == 4  # the paper states it: not searched


def test_one_pinned_set_of_constants_per_generation():
    """Changing a constant to fit one table must be a visible change here (and in
    benchmarks/results/planner.md), never a silent refit."""
    assert KERNELS == {
        "A100": KernelConstants("A100", gemm=0.7, mamf=0.87, attn_fwd=0.6, attn_bwd=0.5,
                                hbm=0.8, nvlink=0.78, nic=0.92),
        "H100": KernelConstants("H100", gemm=0.5, mamf=0.8, attn_fwd=0.6, attn_bwd=0.45,
                                hbm=0.8, nvlink=0.8, nic=0.92),
        "H200": KernelConstants("H200", gemm=0.5, mamf=0.8, attn_fwd=0.6, attn_bwd=0.45,
                                hbm=0.8, nvlink=0.8, nic=0.92),
    }
    for name, _ in TABLES:  # no table overrides its generation's GEMM share
        assert SOURCES[name].cluster().achievable_fraction == hardware.kernel_constants(
            SOURCES[name].cluster().device).gemm


@pytest.mark.parametrize(("changed", "tables"), [("H100", A100_TABLES), ("A100", H100_TABLES)])
def test_a_tables_fit_cannot_move_another_generations_predictions(reference, monkeypatch,
                                                                   changed, tables):
    """Refitting one generation's row (here: every share at 0.9× or 0.5×) leaves the other
    generation's tables bit-identical: their constants are not shared."""
    before = _predictions(reference, tables)
    row = KERNELS[changed]
    monkeypatch.setitem(KERNELS, changed, replace(
        row, gemm=row.gemm * 0.9, mamf=row.mamf * 0.9, attn_fwd=row.attn_fwd * 0.5,
        attn_bwd=row.attn_bwd * 0.5, hbm=row.hbm * 0.5, nvlink=row.nvlink * 0.5,
        nic=row.nic * 0.5))
    after = _predictions(reference, tables)
    assert {k: p.predicted for k, p in after.items()} == {
        k: p.predicted for k, p in before.items()}


def test_unknown_source_is_refused():
    with pytest.raises(ValueError, match="'megatron_2019' is unknown"):
        predict_row("megatron_2019", {})

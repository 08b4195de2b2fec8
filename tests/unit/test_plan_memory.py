"""Per-rank memory model: ZeRO Table I and the Korthikanti activation formulas."""

import pytest

from hpctrain.models.config import PRESETS
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.formulas import (
    layer_activation_bytes,
    memory_breakdown,
    model_state_bytes,
)
from hpctrain.plan.shapes import GPTShape, rank_params

GB = 1e9
_PSI = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}
_STAGE = {"os": 1, "os_g": 2, "os_g_p": 3}


def _zero_cells(rows):
    for row in rows:
        for column, value in row.items():
            if column == "dp":
                continue
            size, stage = column.split("_", 1)
            yield int(row["dp"]), _PSI[size], _STAGE[stage], float(value)


def test_zero_table1_every_cell(reference):
    """Each cell within max(1 GB, 0.5%): the paper rounds or truncates to 3–4 digits."""
    cells = list(_zero_cells(reference("zero_memory_table1.csv")))
    assert len(cells) == 27
    for dp, psi, stage, table_gb in cells:
        got = model_state_bytes(psi, dp=dp, zero=stage, precision="bf16").total / GB
        assert got == pytest.approx(table_gb, abs=max(1.0, 0.005 * table_gb)), (dp, psi, stage)
        # Tighter: every cell here is exact to the table's printed precision.
        assert abs(got - table_gb) <= 0.05 + 1e-9, (dp, psi, stage, got)


def test_model_states_per_stage_and_precision():
    s = model_state_bytes(100.0, dp=4, zero=0, precision="bf16")
    assert (s.params, s.grads, s.optimizer) == (200, 200, 1200)
    s = model_state_bytes(100.0, dp=4, zero=3, precision="fp32")
    assert (s.params, s.grads, s.optimizer) == (100, 100, 200)
    s = model_state_bytes(100.0, dp=4, zero=1, precision="bf16", offload="cpu")
    assert (s.params, s.grads, s.optimizer, s.host) == (200, 200, 0, 300)


def test_model_states_reject_bad_values():
    with pytest.raises(ValueError, match="zero=4"):
        model_state_bytes(1.0, zero=4)
    with pytest.raises(ValueError, match="precision='int8'"):
        model_state_bytes(1.0, precision="int8")


def test_activation_formulas_korthikanti_table2():
    m = GPTShape("gpt", n_layers=1, dim=1024, n_heads=16, vocab_size=51200, max_seq_len=2048)
    s, b, h, a, t = 2048, 2, 1024, 16, 4
    sbh = s * b * h
    kw = dict(seq_len=s, micro_batch_size=b)
    assert layer_activation_bytes(m, **kw) == sbh * (34 + 5 * a * s / h)
    assert layer_activation_bytes(m, tp=t, **kw) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer_activation_bytes(m, tp=t, sp=True, **kw) == sbh / t * (34 + 5 * a * s / h)
    assert layer_activation_bytes(m, tp=t, recompute="selective", **kw) == sbh * (10 + 24 / t)
    assert layer_activation_bytes(m, tp=t, sp=True, recompute="selective", **kw) == sbh * 34 / t
    assert layer_activation_bytes(m, recompute="full", **kw) == 2 * sbh


def test_rank_params_shards_layers_and_embeddings():
    m = PRESETS["llama3_8b"]
    assert rank_params(m) == m.num_params()
    layers = m.n_layers * m.layer_params()
    extra = m.num_params() - layers
    assert rank_params(m, tp=2, pp=4) == pytest.approx((layers / 4 + extra / 2) / 2)


def test_breakdown_llama8b_single_gpu_does_not_fit_80gb():
    m = PRESETS["llama3_8b"]
    mem = memory_breakdown(m, Layout(), seq_len=8192, micro_batch_size=1, in_flight=1)
    assert mem.params == 2 * m.num_params()
    assert mem.optimizer == 12 * m.num_params()
    assert mem.total > 16 * m.num_params()
    assert not mem.fits(80 * 2**30)


def test_breakdown_zero3_dp8_shrinks_states_adds_prefetch_buffer():
    m = PRESETS["llama3_8b"]
    kw = dict(seq_len=4096, micro_batch_size=1, in_flight=1, recompute="full")
    base = memory_breakdown(m, Layout(dp=8), **kw)
    z3 = memory_breakdown(m, Layout(dp=8, zero=3), **kw)
    assert z3.params + z3.grads + z3.optimizer == pytest.approx(
        (base.params + base.grads + base.optimizer) / 8)
    assert z3.buffers > base.buffers
    assert z3.fits(80 * 2**30)


def test_async_checkpoint_stages_the_rank_shard_on_the_host():
    """12 bytes (fp32 master + m + v) per parameter the rank owns, in any precision; off the
    device total; none with synchronous saves."""
    m = PRESETS["llama3_8b"]
    kw = dict(seq_len=4096, micro_batch_size=1, in_flight=1)
    z1 = memory_breakdown(m, Layout(dp=8, zero=1, tp=2, pp=2), **kw)
    assert z1.staging == pytest.approx(12 * rank_params(m, tp=2, pp=2) / 8)
    z0 = memory_breakdown(m, Layout(dp=8, tp=2, pp=2), precision="fp32", **kw)
    assert z0.staging == pytest.approx(12 * rank_params(m, tp=2, pp=2))
    sync = memory_breakdown(m, Layout(dp=8, zero=1), checkpoint_async=False, **kw)
    assert sync.staging == 0 and sync.total == memory_breakdown(m, Layout(dp=8, zero=1),
                                                                  **kw).total


def test_in_flight_scales_activations_and_must_be_positive():
    m = PRESETS["medium"]
    kw = dict(seq_len=2048, micro_batch_size=1)
    one = memory_breakdown(m, Layout(pp=4), in_flight=1, **kw)
    four = memory_breakdown(m, Layout(pp=4), in_flight=4, **kw)
    assert four.activations == pytest.approx(4 * one.activations)
    with pytest.raises(ValueError, match="in_flight=0"):
        memory_breakdown(m, Layout(pp=4), in_flight=0, **kw)

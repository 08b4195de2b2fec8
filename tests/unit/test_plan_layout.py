"""Layout validation and the divisibility rules."""

import pytest

from hpctrain.metrics.devices import DEVICES
from hpctrain.models.config import PRESETS
from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.layout import Layout, layout_problems, num_microbatches


def test_layout_rejects_bad_fields_with_the_fix():
    with pytest.raises(ValueError, match="zero=4"):
        Layout(zero=4)
    with pytest.raises(ValueError, match="virtual_stages=2 needs an interleaved schedule"):
        Layout(pp=2, virtual_stages=2)
    with pytest.raises(ValueError, match="zbv"):
        Layout(pp=2, schedule="zbv")
    with pytest.raises(ValueError, match="parallel.dp=0"):
        Layout(dp=0)


def test_layout_problems_names_each_rule():
    m = PRESETS["llama3_8b"]  # 32 heads, 8 kv heads, 32 layers
    lay = Layout(dp=3, tp=3, pp=5)
    problems = layout_problems(m, lay, global_batch=8, micro_batch_size=1)
    assert any("n_heads=32 not divisible by tp=3" in p for p in problems)
    assert any("n_layers=32 not divisible by pp×v=5" in p for p in problems)
    assert any("global_batch=8 not divisible by mbs×dp=3" in p for p in problems)
    ok = Layout(dp=2, tp=4, pp=2, virtual_stages=2, schedule="interleaved_1f1b")
    assert layout_problems(m, ok, global_batch=8, micro_batch_size=1) == []
    assert layout_problems(m, ok, global_batch=6, micro_batch_size=1)  # m=3, not % pp


def test_num_microbatches_error_says_what_to_choose():
    assert num_microbatches(64, micro_batch_size=2, dp=4) == 8
    with pytest.raises(ValueError, match="multiple of 12"):
        num_microbatches(64, micro_batch_size=3, dp=4)


def test_cluster_rejects_bad_fraction():
    with pytest.raises(ValueError, match="achievable_fraction=1.5"):
        ClusterSpec(DEVICES["H100-SXM"], gpus_per_node=8, intra_node_bw=450e9,
                    inter_node_bw=400e9, achievable_fraction=1.5)

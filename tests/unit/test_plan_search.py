"""Layout search: obvious winners, validity of every candidate, and loser reasons."""

import pytest

from hpctrain.models.config import PRESETS
from hpctrain.plan.cluster import megatron_a100_cluster
from hpctrain.plan.layout import Layout, layout_problems
from hpctrain.plan.search import search_layouts


@pytest.fixture(scope="module")
def cluster():
    return megatron_a100_cluster()


def test_tiny_model_on_one_node_picks_pure_dp(cluster):
    out = search_layouts(PRESETS["small"], cluster, n_devices=8, global_batch=64,
                         micro_batch_size=4, seq_len=512)
    best = out[0]
    assert (best.layout.dp, best.layout.tp, best.layout.pp) == (8, 1, 1)
    assert best.recompute == "none" and best.reason == "best"
    assert all(c.reason.startswith("slower:") for c in out[1:] if c.fits)


def test_70b_on_64_gpus_needs_sharding(cluster):
    out = search_layouts(PRESETS["llama3_70b"], cluster, n_devices=64, global_batch=256,
                         micro_batch_size=1, seq_len=4096)
    best = out[0]
    assert best.fits
    assert best.layout.tp > 1 or best.layout.pp > 1 or best.layout.zero > 0
    plain = [c for c in out if (c.layout.dp, c.layout.zero) == (64, 0)]
    assert plain and not any(c.fits for c in plain)
    assert all(c.reason.startswith("does not fit: ") and "GiB > 80.0 GiB" in c.reason
               for c in plain)
    crossing = [c for c in out if c.fits and c.layout.tp == 16]
    assert crossing and all("tp all-reduce crosses nodes" in c.reason for c in crossing)


def test_every_candidate_is_valid(cluster):
    model = PRESETS["medium"]
    out = search_layouts(model, cluster, n_devices=16, global_batch=32, micro_batch_size=2,
                         seq_len=2048, schedules=("1f1b", "interleaved_1f1b", "zbv"))
    assert out
    for c in out:
        assert c.layout.n_devices == 16
        assert not layout_problems(model, c.layout, global_batch=32, micro_batch_size=2)
        assert c.layout.sp == (c.layout.tp > 1)
    fitting = [c.time.step_time_s for c in out if c.fits]
    assert fitting == sorted(fitting)


def test_deep_pipeline_with_few_microbatches_reports_its_bubble(cluster):
    out = search_layouts(PRESETS["medium"], cluster, n_devices=8, global_batch=8,
                         micro_batch_size=1, seq_len=2048, schedules=("1f1b",))
    deep = next(c for c in out if c.layout == Layout(dp=1, pp=8) and c.recompute == "none")
    assert "bubble 47%" in deep.reason  # (p-1)/(m+p-1) = 7/15


def test_no_valid_layout_gives_empty_list(cluster):
    assert search_layouts(PRESETS["small"], cluster, n_devices=7, global_batch=3,
                          micro_batch_size=1, seq_len=128) == []


def test_branch_and_bound_keeps_the_exact_winners(cluster):
    """exact_top=k simulates only what can still win: the first k (and their order and times)
    equal the full search's, every pruned candidate's bound is below its simulated time, and
    an `accept` that refuses the fastest moves the exact set past it."""
    kw = dict(n_devices=16, global_batch=64, micro_batch_size=1, seq_len=2048,
              context_parallel=(1, 2))
    model = PRESETS["llama3_8b"]
    full = search_layouts(model, cluster, **kw)
    fast = search_layouts(model, cluster, **kw, exact_top=5)
    key = [(c.layout, c.recompute, c.time.step_time_s) for c in fast[:5]]
    assert key == [(c.layout, c.recompute, c.time.step_time_s) for c in full[:5]]
    assert all(c.exact for c in fast[:5])
    pruned = [c for c in fast if not c.exact]
    assert pruned and all(c.layout.pp > 1 and "not simulated" in c.reason for c in pruned)
    exact_time = {(c.layout, c.recompute): c.time.step_time_s for c in full}
    assert all(c.time.step_time_s <= exact_time[c.layout, c.recompute] for c in pruned)
    assert all(c.time.step_time_s >= fast[4].time.step_time_s for c in pruned)
    refused = {(c.layout, c.recompute) for c in full[:5]}
    out = search_layouts(model, cluster, **kw, exact_top=5,
                         accept=lambda c: (c.layout, c.recompute) not in refused)
    taken = [c for c in out if c.fits and (c.layout, c.recompute) not in refused][:5]
    assert [(c.layout, c.recompute) for c in taken] == [
        (c.layout, c.recompute) for c in full if (c.layout, c.recompute) not in refused][:5]
    assert all(c.exact for c in taken)

"""Bench arithmetic without processes: busbw formulas, pairings, shapes, outliers, config."""

from __future__ import annotations

import pytest

from hpctrain.bench.comm import bus_bandwidth
from hpctrain.bench.gemm import model_shapes
from hpctrain.bench.outliers import (
    exclude_line,
    find_outliers,
    gemm_rank_scores,
    nodes_to_exclude,
)
from hpctrain.bench.p2p import round_robin
from hpctrain.config.bench import BenchConfig
from hpctrain.models.config import PRESETS
from tests.conftest import CONF, compose, make_config


@pytest.mark.parametrize("n, factors", [
    (2, {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5,
         "broadcast": 1.0}),
    (8, {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875,
         "broadcast": 1.0}),
])
def test_busbw_is_nccl_tests_definition(n, factors):
    for collective, factor in factors.items():
        assert bus_bandwidth(collective, 10.0, n) == pytest.approx(10.0 * factor)


def test_busbw_rejects_unknown_collective():
    with pytest.raises(ValueError, match="all_reduce"):
        bus_bandwidth("allreduce", 1.0, 2)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_round_robin_covers_every_pair_once_in_disjoint_rounds(n):
    rounds = round_robin(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(i, j) for i in range(n) for j in range(i + 1, n)]
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))


def test_sizes_are_powers_of_two_up_to_the_cap():
    assert BenchConfig(min_bytes=1024, max_bytes=9000).sizes() == [1024, 2048, 4096, 8192]


def test_model_shapes_split_by_tp():
    m = PRESETS["llama3_8b"]
    shapes = {name: (mm, k, n) for _, name, mm, k, n in model_shapes(m, tokens=4096, tp=4)}
    assert shapes["qkv"] == (4096, 4096, (4096 + 2 * 8 * 128) // 4)
    assert shapes["o"] == (4096, 1024, 4096)
    assert shapes["mlp_down"] == (4096, 14336 // 4, 4096)
    assert shapes["output"] == (4096, 4096, 128256 // 4)


def _gemm(rank, node, tflops, shape="1024^3"):
    return {"bench": "gemm", "rank": rank, "node": node, "kind": "square", "shape": shape,
            "precision": "bf16", "tflops": tflops}


def test_gemm_outlier_names_the_slow_rank_and_its_node_only():
    recs = [_gemm(r, f"n{r // 2}", 100.0 if r != 5 else 40.0, s)
            for r in range(8) for s in ("a", "b")]
    scores = gemm_rank_scores(recs)
    assert scores[5] == pytest.approx(0.4) and scores[0] == pytest.approx(1.0)
    found = find_outliers(recs, fraction=0.8)
    assert [(f.level, f.name, f.nodes) for f in found] == [("rank", "rank 5", ("n2",))]
    assert exclude_line(nodes_to_exclude(found)) == "--exclude=n2"


def test_healthy_cluster_has_no_outliers_and_no_exclude_line():
    recs = [_gemm(r, f"n{r}", 100.0 + r) for r in range(4)]
    assert find_outliers(recs, fraction=0.8) == []
    assert exclude_line([]) is None


def _links(bw, *, n=8, per_node=4):
    """n ranks, per_node per node (a, b, ...); bw(src, dst) → GB/s."""
    node = lambda r: "ab"[r // per_node]  # noqa: E731
    return [{"bench": "p2p", "rank": s, "node": node(s), "src": s, "dst": d, "src_node": node(s),
             "dst_node": node(d), "bw_GBps": bw(s, d), "latency_s": 1e-5}
            for s in range(n) for d in range(n) if s != d]


def test_p2p_slow_rank_flags_it_and_its_node_not_the_healthy_ones():
    def bw(s, d):
        base = 50.0 if s // 4 == d // 4 else 20.0  # intra-node links are faster by design
        return base / 10 if 5 in (s, d) else base

    found = find_outliers(_links(bw), fraction=0.8)
    assert {f.name for f in found if f.level == "rank"} == {"rank 5 (intra-node)",
                                                            "rank 5 (inter-node)"}
    assert nodes_to_exclude(found) == ["b"]


def test_p2p_one_bad_link_is_reported_but_excludes_no_node():
    found = find_outliers(_links(lambda s, d: 1.0 if (s, d) == (0, 6) else 20.0), fraction=0.8)
    assert [f.name for f in found] == ["link 0→6 (inter-node)"]
    assert nodes_to_exclude(found) == []


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "bench").glob("*.yaml")))
def test_every_bench_option_validates(option, tmp_path):
    c = make_config(["task=bench", f"bench={option}"], run_dir=tmp_path)
    assert c.extra["bench"]["name"] == option


@pytest.mark.parametrize("overrides, message", [
    (["task=bench", "bench.name=nccl"], "bench.name='nccl' is not one of"),
    (["task=bench", "bench=comm", "+bench.iter=3"], "Did you mean bench.iters"),
    (["task=bench", "bench=comm", "bench.max_bytes=10", "bench.min_bytes=64"],
     "bench.max_bytes=10 < bench.min_bytes=64"),
    (["task=bench", "bench=comm", "bench.collectives=[allreduce]"], "'allreduce'"),
    (["task=bench", "bench=comm", "bench.slow_ranks=[3]"], r"outside 0\.\.0"),
    (["task=bench", "bench=comm", "bench.outlier_fraction=1.5"], "must be in"),
    (["task=bench", "bench=gemm", "bench.precisions=[tf32]", "cluster.device=cpu"], "only on CUDA"),
])
def test_bench_mistakes_are_clear_errors(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_config(overrides, run_dir=tmp_path)


def test_bench_accepts_tp_with_pp_layouts(tmp_path):
    """tp inside pipeline stages is built, so bench=train takes a tp×pp layout like bench=comm."""
    layout = ["parallel.tp=2", "parallel.pp=2", "cluster.procs_per_node=4"]
    for name in ("comm", "train"):
        c = make_config(["task=bench", f"bench={name}", *layout], run_dir=tmp_path)
        assert c.parallel.tp == 2 and c.parallel.pp == 2


def test_every_bench_option_lists_every_key():
    """Every key can be overridden in a sweep (bench=comm,gemm bench.iters=3): the composed
    option has every key (the schema supplies what its YAML does not restate)."""
    import dataclasses

    keys = {f.name for f in dataclasses.fields(BenchConfig)}
    for path in (CONF / "bench").glob("*.yaml"):
        assert set(compose(["task=bench", f"bench={path.stem}"]).bench) == keys, path.name


def test_ep_groups_are_consecutive_dp_ranks_at_fixed_tp():
    from hpctrain.distributed.dims import ParallelDims

    d = ParallelDims(dp=4, tp=2, ep=2)
    assert d.all_of(d.ep_ranks) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    d = ParallelDims(dp=4, pp=2, ep=4)
    assert d.all_of(d.ep_ranks) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="parallel.ep=3 must be >= 1 and divide parallel.dp=4"):
        ParallelDims(dp=4, ep=3)



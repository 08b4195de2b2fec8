"""The layout is described once (hpctrain.distributed.dims.ParallelDims): every consumer derives
from it and agrees, over many random valid layouts — the config's world size, the planner's
Layout and what `parallel=auto` applies, the Slurm node count, the mesh's named groups (their
sizes and nesting) and the cluster benchmark's group names."""

from __future__ import annotations

import dataclasses
import math
import random
import typing

import pytest

from hpctrain.config.bench import AxisGroup
from hpctrain.config.schema import ParallelConfig
from hpctrain.distributed.dims import GROUP_NAMES, ParallelDims, divisors
from hpctrain.launch.resolvers import nodes_for
from hpctrain.plan.layout import Layout


def _random_parallel(rng: random.Random) -> ParallelConfig:
    dp, tp, pp, cp = (rng.choice([1, 2, 3, 4, 6]) for _ in range(4))
    replicate = rng.choice(divisors(dp))
    ep = rng.choice(divisors(dp // replicate))
    schedule = rng.choice(["1f1b", "gpipe", "zb_h1", "interleaved_1f1b", "zbv"])
    return ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=replicate,
                          zero=rng.choice([0, 1, 2, 3]), sp=tp > 1 and rng.random() < 0.5,
                          schedule=schedule, cp_comm=rng.choice(["ring", "allgather"]),
                          virtual_stages=2 if schedule in ("interleaved_1f1b", "zbv") else 1)


LAYOUTS = [_random_parallel(random.Random(seed)) for seed in range(150)]


def _sizes(d: ParallelDims) -> dict[str, int]:
    return {"world": d.world_size, "pp": d.pp, "dp": d.dp, "cp": d.cp, "tp": d.tp,
            "dp_cp": d.dp * d.cp, "shard": d.shard_size, "replicate": d.dp_replicate,
            "ep": d.ep, "edp": d.expert_shard_size, "cp_tp": d.cp * d.tp}


@pytest.mark.parametrize("p", LAYOUTS, ids=lambda p: Layout.of(p).describe().replace(" ", "_"))
def test_every_consumer_agrees_on_the_layout(p):
    d = p.dims
    assert p.world_size == d.world_size == Layout.of(p).n_devices == p.dp * p.tp * p.pp * p.cp
    assert Layout.of(p).dims == d
    # parallel=auto applies a layout whole: every field of it, nothing left from before
    assert Layout.of(Layout.of(p).applied_to(ParallelConfig())) == Layout.of(p)
    for ppn in (1, 4, 8):
        assert nodes_for(dataclasses.asdict(p), ppn) == math.ceil(d.world_size / ppn)
    sizes = _sizes(d)
    for name in GROUP_NAMES:
        partition = d.all_of(lambda r, n=name: d.ranks_in(n, r))
        assert sorted(r for g in partition for r in g) == list(range(d.world_size)), name
        assert {len(g) for g in partition} == {sizes[name]}, name
        where = {r: g for g in partition for r in g}  # the rank's own group, computed once
        assert all(d.ranks_in(name, r) == where[r] for r in range(d.world_size)), name
    for name in ("tp", "cp", "dp", "ep", "pp", "replicate"):  # what the planner's links read
        for rank in range(d.world_size):
            members = d.ranks_in(name, rank)
            gaps = {b - a for a, b in zip(members, members[1:], strict=False)}
            assert gaps <= {d.stride(name)}, name
    for rank in range(d.world_size):
        shard, dp_cp = set(d.ranks_in("shard", rank)), set(d.ranks_in("dp_cp", rank))
        assert shard <= dp_cp and set(d.ranks_in("replicate", rank)) & shard == {rank}
        assert set(d.ranks_in("ep", rank)) | set(d.ranks_in("edp", rank)) <= shard
        assert set(d.ranks_in("ep", rank)) & set(d.ranks_in("edp", rank)) == {rank}


def test_layout_fields_are_parallel_keys_and_bench_groups_are_mesh_groups():
    config_keys = {f.name for f in dataclasses.fields(ParallelConfig)}
    assert {f.name for f in dataclasses.fields(Layout)} <= config_keys
    assert set(typing.get_args(AxisGroup)) <= set(GROUP_NAMES)


def test_nodes_count_every_axis_cp_included():
    p = ParallelConfig(dp=2, cp=4)
    assert nodes_for(dataclasses.asdict(p), 4) == 2


@pytest.mark.parametrize("overrides, match", [
    (["parallel.dp=4", "parallel.dp_replicate=3"],
     r"parallel.dp_replicate=3 does not divide parallel.dp=4 .*among \[1, 2, 4\]"),
    (["parallel.dp=4", "parallel.dp_replicate=2", "parallel.dp_shard=4"],
     r"parallel.dp_shard=4 × parallel.dp_replicate=2 = 8, but parallel.dp=4: set "
     r"parallel.dp_shard=2"),
    (["parallel.dp=4", "parallel.dp_replicate=0"], r"parallel.dp_replicate=0"),
    (["parallel.dp=4", "parallel.dp_replicate=4", "model=debug_moe", "parallel.ep=2"],
     r"parallel.ep=2 does not divide parallel.dp_shard=1"),
    (["parallel.dp=8", "parallel.dp_replicate=2", "cluster=slurm", "cluster.procs_per_node=8",
      "parallel.tp=3"],
     r"a shard group of parallel.dp_shard=4 × cp=1 × tp=3 = 12 ranks straddles nodes"),
])
def test_bad_hsdp_triples_are_refused_naming_the_fix(overrides, match, tmp_path):
    from tests.conftest import make_config

    with pytest.raises(ValueError, match=match):
        make_config(["model=debug", *overrides], run_dir=tmp_path)


def test_hsdp_accepted_with_dp_shard_given_or_derived(tmp_path):
    from tests.conftest import make_config

    for extra in ([], ["parallel.dp_shard=2"]):
        cfg = make_config(["model=debug", "parallel.dp=4", "parallel.dp_replicate=2",
                           "cluster.procs_per_node=4", *extra], run_dir=tmp_path)
        assert (cfg.parallel.dims.dp_shard, cfg.parallel.dims.dp_replicate) == (2, 2)


def test_auto_applies_the_expert_degree_it_chose(tmp_path):
    """parallel=auto on a MoE model: the config each candidate runs has the candidate's ep (and
    every other field), whatever the user's parallel.ep was."""
    from hpctrain.plan.auto import with_layout
    from hpctrain.plan.cluster import dgx_h100_cluster
    from hpctrain.plan.search import evaluate_layout
    from tests.conftest import make_config

    cfg = make_config(["model=debug_moe", "parallel.dp=4", "parallel.ep=1",
                       "cluster.procs_per_node=4"], run_dir=tmp_path)
    for ep in (2, 4):
        lay = Layout(dp=4, zero=1, ep=ep)
        c = evaluate_layout(cfg.model, dgx_h100_cluster(), lay, "none", global_batch=16,
                            micro_batch_size=4, seq_len=64, precision="fp32", dp_overlap=0.0,
                            exact=False)
        ran = with_layout(cfg, c)
        assert ran.parallel.ep == ep and Layout.of(ran.parallel) == lay


def test_no_group_parameter_defaults_to_none():
    """Groups are passed, never defaulted: a `*group*` parameter with a None default once meant
    four different things (one rank, the world, the engine's group, no pair)."""
    import ast
    from pathlib import Path

    found = []
    for path in (Path(__file__).resolve().parents[2] / "hpctrain").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            pairs = list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults, strict=True))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d]
            found += [f"{path}:{node.lineno} {node.name}({arg.arg}=None)" for arg, d in pairs
                      if "group" in arg.arg and isinstance(d, ast.Constant) and d.value is None]
    assert not found, found


def _module_names(preset: str) -> set[str]:
    from hpctrain.models import PRESETS, build_model

    model = build_model(PRESETS[preset], seed=0)
    return {seg for n, _ in model.named_parameters() for seg in n.split(".")[:-1]
            if not seg.isdigit()}


def test_parallel_and_train_never_name_the_models_modules():
    """The model is its own pipeline stage and its family declares its parts (#22 item 3):
    no attribute access or name string in parallel/ or train/ spells one of the decoder's
    module names (`x.tok_embeddings`, `"layers.0.attn.wq"`) except through the family; the
    routed experts' own parameters (w1, w2, w3 of models.moe's experts) may be named by the
    expert-parallel code that shards them. "norm" and "output" are common words: only as
    strings. And no `llama` under parallel/ at all."""
    import ast
    from pathlib import Path

    import hpctrain

    names = _module_names("debug")
    root = Path(hpctrain.__file__).parent
    found = []
    for package in ("parallel", "train"):
        for path in sorted((root / package).rglob("*.py")):
            allowed = {"w1", "w2", "w3"} if path.parent.name == "moe" else set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute):
                    hit = node.attr in names - {"norm", "output"} - allowed and node.attr
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    head = node.value.split(".")[0]
                    hit = " " not in node.value and head in names - allowed and node.value
                else:
                    hit = None
                if hit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {hit}")
            if package == "parallel" and "llama" in path.read_text().lower():
                found.append(f"{path.relative_to(root)} names llama")
    assert not found, found

"""The ParallelState's shard spec, built by the trainer's own set-up on real layouts: every
parameter of a tp=2 × pp=2 model has the right tp dim and stage, its values on each rank are
exactly the spec's slice of the single-process model, and the slices add back up to the full
model. Also: a degree-1 mesh axis is a one-rank group, and set-up attaches nothing to modules.
"""

from __future__ import annotations

import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh, group_size
from hpctrain.models import build_model
from hpctrain.parallel.data.state import full_model_state
from hpctrain.train.setup import build_parallel_state
from tests.conftest import make_config
from tests.parallel.trainer_runs import BASE

COLUMN = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")
ROW = ("attn.wo", "mlp.w2")


def _spec_on_rank(overrides: list[str]) -> dict:
    """Build this rank's ParallelState as the trainer does; report its spec per parameter and
    whether the rank's values are the spec's slice of the single-process model."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = make_config([*BASE, f"cluster.procs_per_node={dist.get_world_size()}",
                           *overrides], run_dir=run_dir)
    p = cfg.parallel
    mesh = build_mesh(ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp), rank=dist.get_rank(),
                      device=torch.device("cpu"))
    state, _ = build_parallel_state(cfg, mesh)
    reference = dict(build_model(cfg.model, seed=cfg.train.seed).named_parameters())
    values = full_model_state(state.engine)  # this rank's tp slices, whole over dp
    specs = {}
    for name, s in state.shards.items():
        want = s.local_of(reference[name].detach())
        specs[name] = {"tp": (s.tp.dim, s.tp.index, s.tp.parts, s.tp.replicas),
                       "stage": s.stage, "local": s.local_shape, "full": s.full_shape,
                       "dp_shards": s.dp_shards, "held_by": s.held_by,
                       "exact": torch.equal(values[name], want)}
    return {"coords": mesh.dims.coords(mesh.rank),
            "specs": specs,
            "full": {n: tuple(t.shape) for n, t in reference.items()},
            "attached": sorted({type(m).__name__ for m in state.model.modules()
                                if hasattr(m, "tp_plan")}
                               | ({"optimizer"} if hasattr(state.engine.optimizer, "engine")
                                  else set())),
            "group_sizes": {a: group_size(mesh.group(a)) for a in ("dp", "tp", "pp")}}


def _expected_tp_dim(name: str) -> int | None:
    module = name.rpartition(".")[0]
    if module in ("tok_embeddings", "output") or module.endswith(COLUMN):
        return 0
    return 1 if module.endswith(ROW) else None


def _expected_stage(name: str, *, n_layers: int, pp: int) -> int:
    if name.startswith("layers."):
        return int(name.split(".")[1]) // (n_layers // pp)
    return 0 if name.startswith("tok_embeddings") else pp - 1


def test_tp2_pp2_spec_has_the_right_tp_dims_stages_and_sums_to_the_model(world4):
    runs = world4.run(_spec_on_rank, ["parallel.tp=2", "parallel.pp=2",
                                      "parallel.schedule=1f1b"])
    full = runs[0]["full"]
    n_layers = 1 + max(int(n.split(".")[1]) for n in full if n.startswith("layers."))
    held: dict[str, int] = {}
    for run in runs:
        assert run["attached"] == [], run["attached"]
        assert run["group_sizes"] == {"dp": 1, "tp": 2, "pp": 2}  # dp: a one-rank group
        for name, s in run["specs"].items():
            dim, index, parts, replicas = s["tp"]
            assert s["exact"], name  # the rank holds exactly the spec's slice
            assert dim == _expected_tp_dim(name), (name, dim)
            assert s["stage"] == _expected_stage(name, n_layers=n_layers, pp=2), name
            assert s["stage"] == run["coords"]["pp"], name  # 1f1b: stage s on pp rank s
            assert s["full"] == full[name], name
            assert index == (run["coords"]["tp"] if dim is not None else 0)
            assert (parts, replicas) == ((2, 1) if dim is not None else (1, 2)), name
            # a value held identically by k tp ranks counts 1/k on each
            held[name] = held.get(name, 0) + torch.Size(s["local"]).numel() // replicas
    assert set(held) == set(full)  # every parameter is on some rank, none invented
    for name, shape in full.items():  # slices (and replicas counted once) sum to the model
        assert held[name] == torch.Size(shape).numel(), name


TIED = ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=1f1b", "model.tied_embeddings=true"]


@pytest.mark.parametrize("overrides", [
    ["parallel.tp=4"],  # 2 kv heads on 4 ranks: wk/wv replicated on 2 ranks each
    ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"],  # dp shards of the flat units
    TIED,  # E on both pp ranks: the head's copy under the embedding's name
], ids=["tp4_kv_replicated", "dp2_tp2_zero1", "tp2_pp2_tied"])
def test_spec_slices_are_exact_with_replicated_kv_dp_shards_and_tied_copies(world4, overrides):
    runs = world4.run(_spec_on_rank, overrides)
    for run in runs:
        for name, s in run["specs"].items():
            assert s["exact"], name
        if "parallel.tp=4" in overrides:
            wk = run["specs"]["layers.0.attn.wk.weight"]["tp"]
            assert wk == (0, run["coords"]["tp"] // 2, 2, 2)
        elif overrides is TIED:
            e = run["specs"]["tok_embeddings.weight"]
            assert "output.weight" not in run["specs"]  # one Parameter, one name
            assert (e["stage"], e["tp"]) == (run["coords"]["pp"], (0, run["coords"]["tp"], 2, 1))
            assert e["held_by"] == 2  # E lives on both pp ranks: the clip norm counts it once
        else:
            shards = {s["dp_shards"] for s in run["specs"].values()}
            assert set().union(*shards) == {0, 1}  # zero=1: both dp shards hold pieces
    # Each element counted once, from where it lives (what the clip norm reads): the local
    # sizes over held_by, summed over the tp and pp ranks of dp coordinate 0, are the model's.
    counted: dict[str, float] = {}
    for run in runs:
        if run["coords"]["dp"] == 0:
            for name, s in run["specs"].items():
                counted[name] = counted.get(name, 0) + torch.Size(s["local"]).numel() / s[
                    "held_by"]
    assert counted == {n: torch.Size(shape).numel() for n, shape in runs[0]["full"].items()}


def _mesh_cost() -> dict:
    """Seconds to build a dp=2 mesh (tp, pp: one-rank groups) and that a collective on a
    one-rank group leaves the value alone."""
    t0 = time.perf_counter()
    mesh = build_mesh(ParallelDims(dp=2), rank=dist.get_rank(), device=torch.device("cpu"))
    seconds = time.perf_counter() - t0
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x, group=mesh.group("tp"))
    return {"seconds": seconds, "x": float(x), "sizes": [group_size(mesh.group(a))
                                                         for a in ("dp", "tp", "pp")]}


def test_a_degree_one_axis_is_a_one_rank_group(world2):
    for rank, out in enumerate(world2.run(_mesh_cost)):
        assert out["sizes"] == [2, 1, 1]
        assert out["x"] == rank + 1  # summed over itself only
        assert out["seconds"] < 2.0, out["seconds"]

"""Each rank hands DCP only its own shard (issue 23): for dp=4 ZeRO-1/2/3, tp=2×dp=2,
pp=2×dp=2 and pp=2×tp=2×dp=2, the bytes a rank plans to save equal its own shard of the fp32
masters and both AdamW moments (padding excluded), every chunk is a view of the optimizer's
own buffers (nothing gathered or copied), all ranks together write the model state exactly
once, and no rank writes much more than 1/world of it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hpctrain.checkpoint.shards import optimizer_flats, unit_chunks
from hpctrain.models import build_model
from tests.parallel.trainer_runs import run_trainer

LAYOUTS = {
    "dp4-zero1": (4, ["parallel.dp=4", "parallel.zero=1"]),
    "dp4-zero2": (4, ["parallel.dp=4", "parallel.zero=2"]),
    "dp4-zero3": (4, ["parallel.dp=4", "parallel.zero=3"]),
    "tp2-dp2": (4, ["parallel.tp=2", "parallel.dp=2"]),
    "pp2-dp2": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"]),
    "3d": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "parallel.zero=1"]),
}


def _own_shard_bytes(engine) -> int:
    """The rank's flat shards of master, exp_avg and exp_avg_sq, less the padding."""
    out = 0
    for unit in engine.units:
        real = unit.layout.shard_size - unit.layout.shard_padding(unit.shard_rank)
        state = engine.optimizer.state[unit.index]
        out += sum(real * state[k].element_size() for k in ("master", "exp_avg", "exp_avg_sq"))
    return out


def _save_facts(overrides: list[str], run_dir: str) -> dict:
    trainer = run_trainer([*overrides, "train.checkpoint_every=0"], run_dir, steps=1)
    parallel = trainer.parallel
    chunks = unit_chunks(parallel, optimizer_flats(parallel))
    own = {t.untyped_storage().data_ptr() for s in parallel.engine.optimizer.state.values()
           for t in s.values()}
    record = trainer.checkpointer.records[-1]
    return {"planned": sum(c.data.nbytes for c in chunks), "own": _own_shard_bytes(parallel.engine),
            "views": all(c.data.untyped_storage().data_ptr() in own for c in chunks),
            "written": record["ckpt_bytes"], "rank": dist.get_rank()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_saves_only_its_own_shard(layout, world4, world8, tmp_path):
    size, overrides = LAYOUTS[layout]
    world = world8 if size == 8 else world4
    facts = world.run(_save_facts, overrides, str(tmp_path))
    for f in facts:
        assert f["planned"] == f["own"] and f["views"], f
    model = build_model(_model_config(), seed=0)
    state = sum(p.numel() for p in model.parameters()) * 12  # fp32 master + two moments
    steps = sum(1 for _ in model.parameters()) * 4  # one fp32 step scalar per parameter
    assert sum(f["written"] for f in facts) == state + steps
    assert max(f["written"] for f in facts) <= 2 * state / size, facts
    files = sorted((tmp_path / "checkpoints" / "step_00000001").glob("__*_0.distcp"))
    assert len(files) == size


def _model_config():
    from tests.conftest import make_config
    from tests.parallel.trainer_runs import BASE

    return make_config(BASE).model

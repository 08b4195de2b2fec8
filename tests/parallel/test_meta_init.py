"""Ranks built on meta (issue 44): each rank's model is built and sharded on the meta device,
and only its own elements are computed, into the engine's units. Every layout's values equal
the single-process model's full initialisation bit for bit: masters gathered over each unit's
group, and the compute parameters at ZeRO 0-2 (bf16 casts included), tied heads held apart
from their embedding included. (The memory of set-up: tests/integration/test_meta_setup.py.)"""

from __future__ import annotations

import pytest

from tests.parallel.trainer_runs import initial_values

LAYOUTS = {  # name: (world size, overrides)
    "dp2_z1_bf16": (2, ["parallel.dp=2", "parallel.zero=1", "train.precision=bf16",
                        "train.allow_slow_precision=true"]),
    "dp2_z3": (2, ["parallel.dp=2", "parallel.zero=3"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "pp2_tied": (2, ["parallel.pp=2", "model.tied_embeddings=true"]),
    "ep2_moe_z2": (2, ["model=debug_moe", "parallel.dp=2", "parallel.ep=2",
                       "parallel.zero=2"]),
    "dp2_tp2_z3_fp8": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3",
                           "train.precision=bf16", "train.fp8=true",
                           "train.allow_slow_precision=true"]),
    "hsdp_z2": (4, ["parallel.dp=4", "parallel.dp_replicate=2", "parallel.zero=2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_rank_computes_its_own_elements_of_the_full_init(name, world2, world4,
                                                               tmp_path):
    size, overrides = LAYOUTS[name]
    world = world2 if size == 2 else world4
    for differ, compared in world.run(initial_values, overrides, str(tmp_path)):
        assert compared > 0 and differ == [], differ

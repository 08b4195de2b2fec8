"""A finished trainer holds nothing: once it is dropped, its process groups (each with a gloo
thread that polls while idle) and its pipeline courier thread are freed. Parameter hooks live in
C++ grad accumulators the garbage collector cannot see, so a hook holding its reducer strongly
kept every finished trainer of a long-lived process alive (a session's test world reached 98
idle gloo groups per rank, a quarter of a core)."""

from __future__ import annotations

import gc
import os
import threading

from tests.parallel.trainer_runs import train_in_world


def _threads() -> dict[str, int]:
    gc.collect()
    tasks = os.listdir("/proc/self/task")
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    couriers = [t for t in threading.enumerate() if t.name == "hpctrain-p2p"]
    return {"gloo": names.count("gloo_tcp_loop"), "courier": len(couriers)}


def test_a_finished_trainer_frees_its_groups_and_threads(world2, tmp_path):
    before = world2.run(_threads)
    for layout in (["parallel.dp=2", "parallel.zero=2"], ["parallel.pp=2"]):
        world2.run(train_in_world, layout, str(tmp_path / layout[0]))
    assert world2.run(_threads) == before

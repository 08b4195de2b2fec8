"""Every wait on a mesh gives up after the mesh's timeout: its axis groups' collectives (torch's
default for `new_group` would be 30 min on gloo) and the pipeline's point-to-point receives."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from hpctrain.distributed.comm import recv
from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh
from tests.harness import World

TIMEOUT_S = 2.0


def _unanswered_waits() -> tuple[float, float] | None:
    """Rank 0 waits for rank 1, which never answers; returns how long each wait lasted."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    mesh = build_mesh(ParallelDims(dp=2), rank=dist.get_rank(), device=torch.device("cpu"),
                      timeout=timeout)
    if dist.get_rank() == 1:
        return None
    waited = []
    for wait in (lambda: dist.all_reduce(torch.ones(1), group=mesh.group("dp")),
                 lambda: recv((1,), dtype=torch.float32, device=mesh.device, src=1, tag=7,
                              timeout=mesh.timeout)):
        t0 = time.monotonic()
        try:
            wait()
        except RuntimeError:
            waited.append(time.monotonic() - t0)
    return tuple(waited)


def test_group_collectives_and_receives_time_out():
    world = World(2, timeout_s=120)  # its own world: the timed-out waits leave it unusable
    try:
        collective_s, p2p_s = world.run(_unanswered_waits, timeout_s=60)[0]
    finally:
        world.close()
    assert TIMEOUT_S * 0.9 < collective_s < TIMEOUT_S + 3, collective_s
    assert TIMEOUT_S * 0.9 < p2p_s < TIMEOUT_S + 3, p2p_s

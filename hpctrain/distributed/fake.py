"""torch's fake process-group backend: a world of any size inside one process.

Every collective and point-to-point call on a "fake" group returns at once without moving
data, so one process can set up any rank of a 16,384-rank job (every group created, every
rank's arithmetic run) on meta tensors: the dry run (`hpctrain.tasks.dryrun.run`). The backend is
registered by a module of torch's test utilities, the one private import it needs, kept here.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch.distributed as dist

BACKEND = "fake"


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, *,
               timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> Iterator[None]:
    """The default process group as rank `rank` of `world_size` on the fake backend, destroyed
    (with every group made from it) on exit. ValueError when a process group already exists
    (the dry run needs this process to itself) or the rank is outside the world."""
    from torch.testing._internal.distributed import fake_pg  # registers the backend

    if dist.is_initialized():
        raise ValueError("a process group already exists in this process: the dry run sets "
                         "up its own fake world; run task=dryrun in a process of its own")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks "
                         f"(0..{world_size - 1})")
    dist.init_process_group(BACKEND, store=fake_pg.FakeStore(), rank=rank,
                            world_size=world_size, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()

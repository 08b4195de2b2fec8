"""gloo on CPU: reduce-scatter against all-reduce of the same buffer, 2 ranks, 1 thread each.

Why hpctrain's gradient reduction all-reduces where it would reduce-scatter on gloo
(hpctrain/parallel/data/ddp.py `_scatters`): gloo's reduce_scatter is the slower of the two.
Prints the median of 5 timed calls (after one warm-up) for 8 MB and 80 MB of fp32.

    python benchmarks/gloo_collectives.py
"""

from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    for numel in (2_000_000, 20_000_000):
        x, out = torch.randn(numel), torch.empty(numel // world)
        seconds = {}
        for name, call in (("all_reduce", lambda x=x: dist.all_reduce(x)),
                           ("reduce_scatter",
                            lambda x=x, out=out: dist.reduce_scatter_single(out, x))):
            call()
            dist.barrier()
            times = []
            for _ in range(5):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            seconds[name] = sorted(times)[2]
        if rank == 0:
            print(f"{numel * 4 / 1e6:.0f} MB: " + ", ".join(
                f"{k} {v * 1e3:.1f} ms" for k, v in seconds.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_rank, args=(2, tempfile.mktemp()), nprocs=2)

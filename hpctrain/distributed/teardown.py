"""Ending a rank's process groups so that the process exits cleanly.

Seen here (bench_dp, bench_cp, 1 run in 6 on a loaded host): a rank returned from its work,
called `destroy_process_group()` and then died at interpreter exit with SIGABRT, "terminate
called without an active exception". Two things caused it, and each alone removed it in 16 runs:
objects in reference cycles that hold gloo work or groups (engines, DDP's reducer) were freed only
during interpreter finalization, after their groups were gone; and one rank tore its groups down
while its peer was still finishing a collective with it. So: collect those cycles while the
interpreter is whole, then (after success only) wait for every rank, then destroy.
"""

from __future__ import annotations

import gc
import logging

import torch.distributed as dist

log = logging.getLogger(__name__)


def close_process_groups(*, clean: bool) -> None:
    """Destroy every process group of this rank. `clean`: every rank finished its work, so wait
    for all of them first (a barrier under the default group's timeout); after a failure no
    barrier is attempted, since a peer may never arrive."""
    if not dist.is_initialized():
        return
    gc.collect()
    if clean:
        try:
            dist.barrier()
        except Exception as err:  # noqa: BLE001 - a peer already gone: still tear down here
            log.warning("ranks did not all reach the final barrier (%s); closing anyway", err)
    dist.destroy_process_group()

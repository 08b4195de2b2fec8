"""The trainer's side of straggler detection (hpctrain.distributed.stragglers): a check every
cluster.straggler_window steps on every rank, and the logging rank's report of the ranks named."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

from hpctrain.config.schema import Config
from hpctrain.distributed import hang_report, stragglers
from hpctrain.distributed.mesh import Mesh
from hpctrain.distributed.rundir import heartbeat_dir

log = logging.getLogger(__name__)


class StragglerWatch:
    """Off (no collective) with one rank, cluster.straggler_window=0, or no flight recorder
    (a mesh outside a launcher): the same on every rank."""

    def __init__(self, cfg: Config, mesh: Mesh, run_dir: Path):
        c = cfg.cluster
        self.every, self.threshold = c.straggler_window, c.straggler_threshold
        self.exclude, self.run_dir, self.logging = c.exclude_stragglers, run_dir, \
            mesh.is_logging_rank
        on = self.every > 0 and mesh.dims.world_size > 1 and hang_report.recording()
        self.window = (stragglers.Window.of(mesh.groups.values(), world=mesh.world,
                                            device=mesh.device) if on else None)
        self.started = False

    def after_step(self, step: int, loggers) -> dict[str, Any]:
        """Collective when due: the first step starts the window, every `every`-th ends one.
        Returns the window's metrics for the step's record (empty when none is due)."""
        if self.window is None or (self.started and step % self.every):
            return {}
        self.started = True
        t0 = time.perf_counter()
        found = self.window.check(hang_report.flight_recorder())
        if found is None:
            return {}
        compute, waited = found
        slow = stragglers.named(compute, self.threshold)
        median = statistics.median(compute)
        out: dict[str, Any] = {"compute_ratio_max": max(compute) / median if median else None,
                               "wait_s_max": max(waited),
                               "straggler_check_s": time.perf_counter() - t0}
        if not slow or not self.logging:
            return out
        hosts = hang_report.hosts_of(heartbeat_dir(self.run_dir))
        who = [f"rank {r} (host {hosts.get(r, '?')}) computed {compute[r]:.2f} s, "
               f"{compute[r] / median:.2f}x the median {median:.2f} s" for r in slow]
        text = (f"straggler in steps {step - self.every + 1}..{step}: {'; '.join(who)} (its "
                f"peers waited up to {max(waited):.2f} s for it; cluster.straggler_threshold="
                f"{self.threshold})" + (": its node is excluded at the next restart"
                                        if self.exclude else ""))
        log.warning("%s", text)
        if loggers is not None:
            loggers.alert("hpctrain straggler", text)
        if self.exclude:
            stragglers.record(self.run_dir, [hosts[r] for r in slow if r in hosts])
        return {**out, "straggler_ranks": slow,
                "straggler_hosts": [hosts.get(r, "?") for r in slow]}

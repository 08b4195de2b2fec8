"""Checks of where a run goes: one node for a local launch, an elastic Slurm job's range of
nodes, and Slurm's warning signal before the time limit."""

from __future__ import annotations

from hpctrain.config.rule import check
from hpctrain.config.schema import Config


@check("cluster.nodes", "cluster.launcher", stage="input")
def check_local_nodes(c: Config) -> list[str]:
    cl = c.cluster
    if cl.launcher != "local" or cl.nodes == 1:
        return []
    return [f"cluster.launcher=local runs on one node but cluster.nodes={cl.nodes}: set "
            "cluster.nodes=1, or use cluster=slurm for several nodes"]


@check("cluster.elastic", "cluster.min_nodes", "cluster.nodes", "cluster.launcher")
def check_elastic(c: Config) -> list[str]:
    """An elastic job runs on min_nodes..nodes nodes of a Slurm cluster."""
    cl = c.cluster
    if not cl.elastic:
        return []
    if cl.launcher != "slurm":
        return [f"cluster.elastic=true needs a Slurm cluster (cluster={cl.name} launches "
                "locally): use cluster=slurm or a site preset, or set cluster.elastic=false"]
    if cl.min_nodes > cl.nodes:
        return [f"cluster.min_nodes={cl.min_nodes} exceeds cluster.nodes={cl.nodes}, the most "
                f"an elastic job runs on: set cluster.min_nodes between 1 and {cl.nodes}"]
    return []


@check("cluster.signal_delay_s", "cluster.time_min", "cluster.launcher")
def check_signal_delay(c: Config) -> list[str]:
    """Slurm sends its warning signal (save, then requeue) signal_delay_s before the limit."""
    cl = c.cluster
    if cl.launcher != "slurm" or cl.signal_delay_s < cl.time_min * 60:
        return []
    return [f"cluster.signal_delay_s={cl.signal_delay_s} is not below cluster.time_min="
            f"{cl.time_min} minutes = {cl.time_min * 60} s: lower cluster.signal_delay_s or "
            f"raise cluster.time_min to {cl.signal_delay_s // 60 + 1} or more"]

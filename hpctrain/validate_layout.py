"""Checks of the layout's degrees: that they fill the job's ranks (`check_world`), how the
data-parallel axis is factored (HSDP: `parallel.dp_replicate`, `parallel.dp_shard`), and the
nodes they run on (one for a local launch; an elastic Slurm job's range), each naming the fix.

dp = dp_replicate × dp_shard (hpctrain.distributed.dims): ZeRO shards over the dp_shard × cp
ranks of one replica, which are consecutive (shard index fastest after cp and tp), and the
replicas all-reduce. On Slurm a shard group should sit inside one node (or fill whole nodes):
dp_shard·cp·tp must divide cluster.procs_per_node or be a multiple of it, else its ZeRO
collectives cross the slow network on every step.
"""

from __future__ import annotations

from hpctrain.config import Config


def check_world(c: Config) -> list[str]:
    p, cl = c.parallel, c.cluster
    world, per_replica = cl.world_size, p.tp * p.pp * p.cp
    if p.world_size == world:
        return []
    fixes = []
    if world >= per_replica and world % per_replica == 0:
        fixes.append(f"set parallel.dp={world // per_replica}")
    if p.world_size % cl.nodes == 0:
        fixes.append(f"set cluster.procs_per_node={p.world_size // cl.nodes}")
    fix = ", or ".join(fixes) or "make dp × cp × tp × pp equal cluster.nodes × procs_per_node"
    return [
        f"parallel.pp={p.pp} × parallel.tp={p.tp} × parallel.cp={p.cp} × parallel.dp={p.dp} = "
        f"{p.world_size} ranks, "
        f"but cluster.nodes={cl.nodes} × cluster.procs_per_node={cl.procs_per_node} = {world}:"
        f" {fix}"
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_hsdp(c: Config) -> list[str]:
    p, ppn = c.parallel, c.cluster.procs_per_node
    if p.dp < 1 or p.dp_replicate < 1 or (p.dp_shard or 1) < 1:
        return []  # the range checks report these
    if p.dp % p.dp_replicate:
        return [f"parallel.dp_replicate={p.dp_replicate} does not divide parallel.dp={p.dp} "
                f"(dp = dp_replicate × dp_shard): choose dp_replicate among {_divisors(p.dp)}"]
    shard = p.dp // p.dp_replicate
    if p.dp_shard is not None and p.dp_shard != shard:
        return [f"parallel.dp_shard={p.dp_shard} × parallel.dp_replicate={p.dp_replicate} = "
                f"{p.dp_shard * p.dp_replicate}, but parallel.dp={p.dp}: set "
                f"parallel.dp_shard={shard} (or leave it unset: dp / dp_replicate)"]
    errs = []
    if p.dp_replicate > 1 and p.ep > 1 and shard % p.ep:
        errs.append(f"parallel.ep={p.ep} does not divide parallel.dp_shard={shard} (an expert "
                    "group lives inside one replica): choose ep among "
                    f"{_divisors(shard)}, or a smaller parallel.dp_replicate")
    group = shard * p.cp * p.tp
    if (p.dp_replicate > 1 and c.cluster.launcher == "slurm" and ppn > 0
            and ppn % group and group % ppn):
        fits = [d for d in _divisors(p.dp) if ppn % (p.dp // d * p.cp * p.tp) == 0
                or (p.dp // d * p.cp * p.tp) % ppn == 0]
        errs.append(f"a shard group of parallel.dp_shard={shard} × cp={p.cp} × tp={p.tp} = "
                    f"{group} ranks straddles nodes of cluster.procs_per_node={ppn} (its ZeRO "
                    f"collectives would cross the network): choose parallel.dp_replicate among "
                    f"{fits}")
    return errs


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


def check_local_nodes(c: Config) -> list[str]:
    cl = c.cluster
    if cl.launcher != "local" or cl.nodes == 1:
        return []
    return [f"cluster.launcher=local runs on one node but cluster.nodes={cl.nodes}: set "
            "cluster.nodes=1, or use cluster=slurm for several nodes"]

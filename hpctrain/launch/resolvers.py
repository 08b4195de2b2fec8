"""OmegaConf resolvers that turn the cluster config into Slurm launcher settings.

Registered where Hydra is entered (`hpctrain.__main__`, also inside its task function, which
a submitit job unpickles and calls; `hpctrain.launch.sbatch`), so
`conf/cluster/slurm.yaml` can derive `nodes` from the parallel layout and build the job's
`setup` lines, `gres` and the job's flags from `cluster.*` instead of repeating them.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence

from omegaconf import OmegaConf

from hpctrain.distributed.dims import AXES


def nodes_for(parallel: Mapping[str, object], procs_per_node: int) -> int:
    """nodes = world / procs_per_node, rounded up, the world being the product of every axis
    of the layout (`ParallelDims.AXES`, read from the `parallel` group): a world that does not
    fill whole nodes then fails `check_world` with its usual message instead of a resolver
    traceback."""
    world = math.prod(int(parallel[axis]) for axis in AXES)
    ppn = max(int(procs_per_node), 1)
    return max(-(-world // ppn), 1)


def gres_for(gpus_per_node: int) -> str | None:
    """`gpu:N` when the nodes have GPUs, else no --gres line at all."""
    return f"gpu:{int(gpus_per_node)}" if int(gpus_per_node) > 0 else None


def env_exports(env: Mapping[str, object] | None) -> list[str]:
    """`export K=V` lines (values shell-quoted), sorted so the job script is stable."""
    return [f"export {k}={shlex.quote(str(v))}" for k, v in sorted((env or {}).items())]


def setup_lines(setup: Sequence[str] | None, env: Mapping[str, object] | None) -> list[str]:
    """The job script's lines before `srun`: the site's setup commands, then the exports
    (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ... from cluster.env) that every rank inherits."""
    return [str(s) for s in (setup or [])] + env_exports(env)


def launcher_setup(setup: Sequence[str] | None, env: Mapping[str, object] | None) -> list[str]:
    """The submitit job script's setup: `setup_lines`, then SLURM_NO_KILL=set, srun's
    --no-kill (submitit's srun takes no flags of ours): a node that fails ends only its own
    tasks, so the ranks still alive report it and requeue the job without it
    (hpctrain.launch.requeue; srun's default would kill them at once)."""
    return [*setup_lines(setup, env), "export SLURM_NO_KILL=set"]


def job_flags(elastic: bool, min_nodes: int, nodes: int) -> dict[str, object]:
    """sbatch flags every training job carries: --requeue (a preemption or node failure brings
    it back), --no-kill (a failed node does not end the allocation: the ranks still alive
    report it and requeue the job without it, hpctrain.launch.requeue) and, elastic, --nodes as
    a range (hpctrain.launch.elastic). No --kill-on-bad-exit: it would end those ranks before
    they report; a rank that gives up ends the step itself."""
    flags: dict[str, object] = {"requeue": True, "no_kill": True}
    if elastic:
        flags["nodes"] = f"{int(min_nodes)}-{int(nodes)}"
    return flags


# ${hpctrain.<name>:...} in conf/cluster/slurm.yaml
RESOLVERS = {
    "hpctrain.nodes": nodes_for,
    "hpctrain.gres": gres_for,
    "hpctrain.setup": lambda setup, env: launcher_setup(_plain(setup), _plain(env)),
    "hpctrain.job_flags": job_flags,
}


def register() -> None:
    """Register the `hpctrain.*` resolvers with OmegaConf (idempotent: replaces them)."""
    for name, fn in RESOLVERS.items():
        OmegaConf.register_new_resolver(name, fn, replace=True)


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

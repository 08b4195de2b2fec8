"""cluster.elastic: each start of a Slurm job runs the world Slurm gave it.

The job asks for `--nodes=<cluster.min_nodes>-<cluster.nodes>`; after a fault that excluded
nodes (hpctrain.launch.requeue) it may come back on fewer, and a later restart with more
healthy nodes grows again, up to cluster.nodes. Every rank calls `fit_world` with the node
count of its allocation and gets the same config back (a pure function of the config and
the count):

1. keep the model-parallel degrees (tp, pp, cp, ep, sp), the schedule, ZeRO, offload and the
   recompute policy, and give the new world to data parallelism: dp = world / (tp·pp·cp); HSDP
   keeps its shard group (a node's ranks) and changes the replica count;
2. if that does not run (the batch does not divide, ep does not divide dp, the run prediction
   does not fit the memory, any validation rule), parallel=auto's search chooses a layout for
   the new world (hpctrain.plan.auto, with the same checks).

The global batch stays (train.global_batch_size): gradient accumulation takes up what fewer
data-parallel ranks leave (micro-batches per step = global / (micro_batch × dp)). The data order
is a function of the step, and the run resumes from its checkpoint at the new layout (every
layout loads every checkpoint), so the loss continues the uninterrupted run's; the step time
changes, and the logs say it.
"""

from __future__ import annotations

import dataclasses
import logging

from hpctrain.config.schema import Config, ParallelConfig
from hpctrain.plan.auto import choose_layout, fit_problems
from hpctrain.tasks import runnable_problems

log = logging.getLogger(__name__)


def kept(p: ParallelConfig, world: int) -> ParallelConfig | None:
    """`p` with data parallelism resized to `world` ranks (step 1), None when the model-parallel
    degrees do not divide it."""
    model = p.tp * p.pp * p.cp
    if world % model:
        return None
    dp = world // model
    shard = p.dp_shard or p.dp // p.dp_replicate
    if p.dp_replicate > 1 and dp % shard == 0:  # HSDP: the shard group stays a node's
        replicate, dp_shard = dp // shard, p.dp_shard
    else:
        replicate, dp_shard = 1, None
    return dataclasses.replace(p, dp=dp, dp_replicate=replicate, dp_shard=dp_shard,
                               microbatches=None)


def fit_world(cfg: Config, nodes: int) -> tuple[Config, str]:
    """`cfg` on `nodes` nodes of cluster.procs_per_node ranks, and a line saying what changed
    (module doc). ValueError, naming what was tried, when no layout runs there."""
    c = cfg.cluster
    if nodes == c.nodes:
        return cfg, f"{nodes} node(s), as configured: {cfg.layout_label}"
    if not c.min_nodes <= nodes <= c.nodes:
        raise ValueError(f"the job has {nodes} node(s) but cluster.min_nodes={c.min_nodes} and "
                         f"cluster.nodes={c.nodes}: Slurm should not have started it there; "
                         "resubmit with --nodes=min-max matching the config")
    world = nodes * c.procs_per_node
    cluster = dataclasses.replace(c, nodes=nodes)
    base = dataclasses.replace(cfg, cluster=cluster)
    why = f"tp{cfg.parallel.tp}·pp{cfg.parallel.pp}·cp{cfg.parallel.cp} does not divide {world}"
    parallel = kept(cfg.parallel, world)
    if parallel is not None:
        candidate = dataclasses.replace(base, parallel=parallel)
        problems = runnable_problems(candidate) or fit_problems(candidate,
                                                                accept=runnable_problems)
        if not problems:
            return candidate, (f"{nodes} of {c.nodes} node(s): kept the model-parallel "
                               f"degrees, {cfg.layout_label} -> {candidate.layout_label}")
        why = problems[0]
    searched = dataclasses.replace(base, parallel=dataclasses.replace(
        cfg.parallel, auto=True, fixed=(), microbatches=None))
    try:
        chosen = choose_layout(searched, accept=runnable_problems)[0]
        chosen = dataclasses.replace(chosen, parallel=dataclasses.replace(
            chosen.parallel, auto=cfg.parallel.auto, fixed=cfg.parallel.fixed))
    except ValueError as err:
        raise ValueError(f"no layout runs on {nodes} node(s) ({world} ranks): keeping the "
                         f"model-parallel degrees fails ({why}); {err}") from err
    return chosen, (f"{nodes} of {c.nodes} node(s): keeping the model-parallel degrees fails "
                    f"({why}); parallel=auto chose {cfg.layout_label} -> {chosen.layout_label}")

"""On Slurm, a fault requeues the job without the nodes it names: no person in the loop.

Where the logic runs: in the job, in the rank that claims the hang report. Jobs carry
`--no-kill` (a failed node does not end the allocation) and `--requeue`, and no
`--kill-on-bad-exit`, so when a node dies or a rank hangs the ranks still alive see it — a
peer's connection closes, or the watchdog's step rule fires — and one of them claims the
report (`hpctrain.distributed.watchdog`). That rank hands the `Fault` to `Requeue`, which

1. takes the nodes to leave out: the nodes Slurm took out of the allocation (a node that
   failed: the job's NodeList now against the one it started on), else the hosts of the ranks
   the report names as gone or frozen (a rank merely behind blames no node: its beat may
   predate the others');
2. refuses when a named rank raised an error (a fault of the code: requeueing would fail
   again) or when cluster.max_restarts faults were requeued already — then the one message
   lists every restart and its cause, and the job ends;
3. records the fault (`hpctrain.distributed.restarts`: the next start completes the record
   with the resumed step) and requeues the job itself through Slurm: `scontrol requeuehold`
   (the job goes back to pending, held, and its processes are signalled), `scontrol update
   ExcNodeList=<every node excluded so far>` (Slurm takes a job's exclude list only while it
   is pending), `scontrol release`. These run in a detached shell that ignores SIGTERM, so
   they finish while Slurm ends the job's processes (KillWait: 30 s by default; they take
   well under a second).

The job then starts again on other nodes — with `cluster.elastic`, on fewer when no others
are free (`hpctrain.launch.elastic`) — and resumes from the newest verified checkpoint.
Whatever ends every rank at once (the batch node itself failing) is requeued by Slurm
without an exclusion, as before.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import time
from pathlib import Path

from hpctrain.config.schema import Config
from hpctrain.distributed import restarts, stragglers
from hpctrain.distributed.hang_report import Fault
from hpctrain.distributed.rundir import work_dir
from hpctrain.launch import task_results

log = logging.getLogger(__name__)

SCONTROL_S = 20  # each scontrol call's limit


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list ("n[1-3],gpu7") expanded by `scontrol show hostnames`."""
    if not nodelist:
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, timeout=SCONTROL_S, check=True).stdout
    return out.split()


def job_nodes(job_id: str) -> list[str] | None:
    """The nodes the job holds now (Slurm drops a failed node from a --no-kill job); None
    when slurmctld does not answer."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=SCONTROL_S, check=True).stdout
        field = next(f for f in out.split() if f.startswith("NodeList="))
        return hostnames(field.split("=", 1)[1].replace("(null)", ""))
    except (OSError, subprocess.SubprocessError, StopIteration):
        return None


def requeue_script(job_id: str, exclude: list[str], *, node_range: str | None = None,
                   min_tasks: int | None = None) -> str:
    """The shell lines that requeue `job_id` without `exclude` (module doc, step 3). An elastic
    job also gets its node range back with the task count of its fewest nodes: Slurm fixes
    both at the first allocation, so the requeued job could not start on fewer (and still
    grows to the most nodes free, with --ntasks-per-node)."""
    job, nodes = shlex.quote(job_id), shlex.quote(",".join(exclude))
    size = (f" NumNodes={node_range} NumTasks={min_tasks}"
            if node_range is not None and min_tasks is not None else "")
    return "\n".join([
        "trap '' TERM HUP INT",
        f"scontrol requeue {job} || {{ echo 'scontrol requeue failed'; exit 1; }}",
        "echo requeued",
        # Pending once its processes are gone (tenths of a second); it becomes eligible to
        # start only after Slurm's requeue delay (seconds), so the exclusion lands first.
        "for i in $(seq 1 200); do",
        f"  scontrol update JobId={job} ExcNodeList={nodes}{size} 2>/dev/null "
        "&& { echo excluded; exit 0; }",
        "  sleep 0.1",
        "done",
        "echo 'the exclusion did not land: the next start requeues again'; exit 1",
    ])


def run_detached(script: str, logfile: Path) -> None:
    """Run `script` in a shell of its own session, no child of this process (`setsid -f`):
    Slurm ends this rank as soon as the job is requeued, and the script must outlive it."""
    with logfile.open("a") as out:
        subprocess.run(["setsid", "-f", "bash", "-c", script], stdout=out,
                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=SCONTROL_S,
                       check=True)


def wait_for_line(logfile: Path, line: str, *, start: int, timeout_s: float) -> bool:
    """True once `line` is among the lines written to `logfile` after byte `start`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = logfile.read_bytes()[start:].decode(errors="replace")
        except OSError:
            text = ""
        if line in text.splitlines():
            return True
        time.sleep(0.05)
    return False


def end_step() -> None:
    """SIGKILL every task of this job step (a stopped one too): the step, and so the job, ends
    now. Logs are flushed first: this process is one of the tasks."""
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    if not job or step is None:
        return
    for handler in logging.getLogger().handlers:
        handler.flush()
    subprocess.run(["scancel", "--signal=KILL", f"{job}.{step}"], capture_output=True,
                   timeout=SCONTROL_S, check=False)


def job_size(cfg: Config, most_nodes: int) -> dict[str, object]:
    """`requeue_script`'s size arguments: an elastic job's node range and fewest tasks."""
    c = cfg.cluster
    return ({"node_range": f"{c.min_nodes}-{most_nodes}",
             "min_tasks": c.min_nodes * c.procs_per_node} if c.elastic else {})


def exclusions(cfg: Config) -> list[str]:
    """Every node the job must leave out: cluster.exclude's, every fault's so far, and the
    stragglers recorded with cluster.exclude_stragglers."""
    given = [n for n in (cfg.cluster.exclude or "").split(",") if n]
    return sorted({*given, *restarts.excluded(cfg.run_dir),
                   *stragglers.excluded(cfg.run_dir)})


def leave_excluded(cfg: Config, *, job_id: str, nodelist: str, most_nodes: int) -> bool:
    """At a start: when the allocation holds a node an earlier fault excluded (the exclusion
    did not land before Slurm started the job), requeue it again without those nodes and
    return True (Slurm ends this process next); else False. Counts no restart."""
    excluded = restarts.excluded(cfg.run_dir)
    here = sorted(set(hostnames(nodelist)) & set(excluded)) if excluded else []
    if not here:
        return False
    all_excluded = exclusions(cfg)
    log.warning("job %s started on %s, excluded after an earlier fault: requeueing it "
                "without %s", job_id, ",".join(here), ",".join(all_excluded))
    run_detached(requeue_script(job_id, all_excluded, **job_size(cfg, most_nodes)),
                 work_dir(cfg.run_dir) / "requeue.log")
    return True


class Requeue:
    """The fault handler a Slurm task gives its watchdog (module doc)."""

    def __init__(self, cfg: Config, *, job_id: str, nodelist_at_start: str, layout: str,
                 most_nodes: int):
        """`cfg` as this start runs it; `most_nodes`: the configured cluster.nodes (an elastic
        start may run fewer)."""
        self.run_dir, self.job_id = Path(cfg.run_dir), job_id
        self.cfg, self.max_restarts = cfg, cfg.cluster.max_restarts
        self.nodelist_at_start, self.layout = nodelist_at_start, layout
        self.world = cfg.cluster.world_size
        self.size = job_size(cfg, most_nodes)
        self.submitted = most_nodes * cfg.cluster.procs_per_node

    def __call__(self, fault: Fault) -> bool:
        """Requeue without the fault's nodes; when not, log why, give submitit that reason as
        every task's result and end the job step, so that no stopped rank keeps the
        allocation (nothing kills on a bad exit)."""
        why = self._requeue_for(fault)
        if why is None:
            return True
        log.error("%s", why)
        task_results.write("error", f"{fault.message}\n{why}", range(self.submitted))
        end_step()
        return False

    def _requeue_for(self, fault: Fault) -> str | None:
        """None once requeued, else why not."""
        if fault.error is not None:
            return (f"not requeued: a rank raised {fault.error}, a fault of the code or the "
                    "data that a restart would meet again; fix it and resubmit (the run "
                    "resumes)")
        now = job_nodes(self.job_id)
        lost = (sorted(set(hostnames(self.nodelist_at_start)) - set(now)) if now is not None
                else [])
        nodes = lost or sorted(fault.nodes)  # Slurm's word first: a failure stalls its peers
        cause = ("node down" if lost else "rank hung or lost" if fault.ranks
                 else "collective stuck")
        earlier = restarts.faults(self.run_dir)
        if len(earlier) >= self.max_restarts:
            this = {"time": time.time(), "cause": cause, "nodes": nodes, "step": fault.step}
            return (f"cluster.max_restarts={self.max_restarts} reached: the job ends. Its "
                    f"restarts and this fault:\n{restarts.describe([*earlier, this])}\nFix the "
                    "nodes or raise cluster.max_restarts and resubmit (the run resumes from "
                    "its newest checkpoint)")
        restarts.record_fault(self.run_dir, cause=cause, nodes=nodes, step=fault.step,
                              world=self.world, layout=self.layout, job_id=self.job_id)
        exclude = exclusions(self.cfg)
        log.warning("%s (%s): requeueing job %s without %s, restart %d of at most %d",
                    cause, ",".join(nodes) or "no node named", self.job_id,
                    ",".join(exclude) or "any node", len(earlier) + 1, self.max_restarts)
        return self._requeue(exclude)

    def _requeue(self, exclude: list[str]) -> str | None:
        logfile = work_dir(self.run_dir) / "requeue.log"
        start = logfile.stat().st_size if logfile.exists() else 0
        resubmit = f"resubmit it with --exclude={','.join(exclude)} (the run resumes)"
        try:
            run_detached(requeue_script(self.job_id, exclude, **self.size), logfile)
        except (OSError, subprocess.SubprocessError) as err:
            return f"could not run scontrol to requeue job {self.job_id} ({err}): {resubmit}"
        if not wait_for_line(logfile, "requeued", start=start, timeout_s=3 * SCONTROL_S):
            return f"scontrol did not requeue job {self.job_id} (see {logfile}): {resubmit}"
        return None  # Slurm ends this process now

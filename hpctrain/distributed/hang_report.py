"""What a hang report says: who holds the job up, where this rank waits, what to do.

Pure functions over the heartbeat files the watchdog writes (`rundir.heartbeat_dir`), so
the rules can be tested without a stuck job. A rank is named, in this order, when it never wrote
a heartbeat, when its beat is stale (its process is stopped, frozen or dead: the watchdog thread
of a live process beats every interval even while the main thread waits), or when it is behind
the others' step. If no rank is, every rank waits in one collective that the network did not
complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpctrain.distributed.rundir import hang_dir as hang_dir_of
from hpctrain.distributed.rundir import heartbeat_dir

Beat = dict[str, Any]

# Text of the errors torch raises when a wait times out or a peer vanishes (gloo raises plain
# RuntimeErrors; NCCL and the stores raise DistError subclasses).
_COMM_MARKERS = ("Timed out waiting", "Connection closed by peer", "Connection reset",
                 "Broken pipe", "gloo/transport", "NCCL", "timed out", "Socket Timeout")


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def on_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


def is_comm_failure(err: BaseException) -> bool:
    """True for a collective / point-to-point wait that timed out or lost its peer."""
    if isinstance(err, dist.DistError):
        return True
    return any(marker in str(err) for marker in _COMM_MARKERS)


def read_heartbeats(folder: Path, *, world_size: int) -> dict[int, Beat | None]:
    """rank → its last heartbeat (None when it never wrote one, or the file is unreadable)."""
    beats: dict[int, Beat | None] = {}
    for rank in range(world_size):
        try:
            beats[rank] = json.loads((folder / f"rank_{rank}.json").read_text())
        except (OSError, ValueError):
            beats[rank] = None
    return beats


def _gone(beat: Beat) -> bool:
    """The process of a heartbeat on this host no longer runs: it does not exist, or it is a
    zombie (dead, not yet reaped by its launcher)."""
    if beat.get("host") != node_name():
        return False
    try:
        pid = int(beat["pid"])
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, ValueError):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _peers_ahead(beats: dict[int, Beat | None], beat: Beat, rank: int) -> str:
    """The step the other ranks reached when it is past the heartbeat's (a beat is written
    within a second of a new step: several short steps can pass in between)."""
    others = [b["step"] for r, b in beats.items()
              if r != rank and b and isinstance(b.get("step"), int)]
    mine = beat.get("step")
    if not others or not isinstance(mine, int) or max(others) <= mine:
        return ""
    return f"; the ranks still running reached step {max(others)} and wait for it there"


FAILED = "failed: "  # the phase a rank's last beat carries when it raised (`Watchdog.failed`)


@dataclass(frozen=True)
class Fault:
    """What ended a job, as the rank that claimed the report saw it: handed to the launcher's
    fault handler (on Slurm: exclude the nodes and requeue, `hpctrain.launch.requeue`)."""

    message: str  # the report
    step: int | None  # the step the reporting rank was in
    ranks: tuple[int, ...]  # the ranks named (empty: every rank waits in one collective)
    nodes: tuple[str, ...]  # the hosts of those gone or frozen (`blamed_nodes`)
    error: str | None  # a named rank raised this: a fault of the code, not of its node


def _at(beat: Beat) -> str:
    return f"step {beat.get('step')} ({beat.get('phase')})"


def suspects(beats: dict[int, Beat | None], *, now: float, stale_s: float) -> list[tuple[int, str]]:
    """(rank, why) of every rank that holds the job up; empty when none stands out."""
    named = [(r, "never wrote a heartbeat") for r, b in beats.items() if b is None]
    named += [(r, f"raised {b['phase'][len(FAILED):]} in step {b.get('step')}")
              for r, b in beats.items() if b and str(b.get("phase")).startswith(FAILED)]
    for rank, beat in beats.items():
        if beat is None or str(beat.get("phase")).startswith(FAILED):
            continue
        age = now - float(beat.get("beat", 0.0))
        if _gone(beat):
            named.append((rank, f"has exited (pid {beat.get('pid')} is gone), last in "
                                f"{_at(beat)}{_peers_ahead(beats, beat, rank)}"))
        elif age > stale_s:
            named.append((rank, f"stopped responding: its last heartbeat, {age:.0f} s ago, "
                                f"was in {_at(beat)}{_peers_ahead(beats, beat, rank)}"))
    if named:
        return named
    steps = {r: b["step"] for r, b in beats.items() if b and b.get("step") is not None}
    if len(set(steps.values())) > 1:
        low, high = min(steps.values()), max(steps.values())
        return [(r, f"is behind in {_at(beats[r])} while others reached step {high}")
                for r, s in steps.items() if s == low]
    return []


def first_line(err: BaseException) -> str:
    """The error's first non-empty line without gloo's "[/path/file.cc:78] " source prefix."""
    line = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    return re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0].rstrip(".")


def waiting_in(*, frame=None, tb=None) -> str | None:
    """Where the main thread waits: the innermost torch.distributed call and the hpctrain line
    that made it, e.g. "all_reduce from hpctrain/parallel/data/ddp.py:88"."""
    if tb is not None:
        entries = traceback.extract_tb(tb)
    elif frame is not None:
        entries = traceback.extract_stack(frame)
    else:
        return None
    comm = [e for e in entries if f"torch{os.sep}distributed" in e.filename]
    ours = [e for e in entries if f"{os.sep}hpctrain{os.sep}" in e.filename
            and "watchdog" not in e.filename]
    if not ours:
        return comm[-1].name if comm else None
    line = ours[-1]
    short = line.filename[line.filename.rfind(f"hpctrain{os.sep}"):]
    return f"{comm[-1].name + ' from ' if comm else ''}{short}:{line.lineno} ({line.name})"


def hosts_of(beats_dir: Path) -> dict[int, str]:
    """rank → the host its heartbeat names."""
    hosts: dict[int, str] = {}
    for path in beats_dir.glob("rank_*.json"):
        try:
            beat = json.loads(path.read_text())
            hosts[int(beat["rank"])] = str(beat["host"])
        except (OSError, ValueError, KeyError):
            continue
    return hosts


# A rank named for one of these is gone or frozen: its node is at fault. One named only for
# being behind may just have written its beat before the others' (a beat lags its step by up
# to a second: dozens of short steps), so its node is not blamed.
_GONE = ("never wrote", "has exited", "stopped responding")


def blamed_nodes(culprits: list[tuple[int, str]], hosts: dict[int, str]) -> list[str]:
    """The hosts of the culprits that are gone or frozen (`_GONE`)."""
    return sorted({hosts[r] for r, why in culprits if r in hosts and why.startswith(_GONE)})


def fault(message: str, *, step: int | None, culprits: list[tuple[int, str]],
          beats: dict[int, Beat | None], beats_dir: Path) -> Fault:
    """The `Fault` a report describes (`culprits` from `suspects`)."""
    raised = [str(b["phase"])[len(FAILED):] for r, b in beats.items()
              if b and str(b.get("phase")).startswith(FAILED)]
    return Fault(message=message, step=step, ranks=tuple(r for r, _ in culprits),
                 nodes=tuple(blamed_nodes(culprits, hosts_of(beats_dir))),
                 error=raised[0] if raised else None)


def format_message(cause: str, *, reporter: int, host: str, step: int | None, phase: str,
                   where: str | None, culprits: list[tuple[int, str]], hang_dir: Path,
                   beats_dir: Path, slurm: bool, saved: Path | None = None,
                   requeues: bool = False) -> str:
    """The one message that ends a hung job (`beats_dir`: the heartbeat files; `saved`: the
    newest finished checkpoint, which a resubmission resumes from; `requeues`: the launcher
    requeues the job itself, without the named nodes)."""
    hosts = hosts_of(beats_dir)
    if culprits:
        head = "; ".join(f"rank {r} (host {hosts.get(r, '?')}) {why}" for r, why in culprits)
    else:
        head = ("no rank is silent or behind: every rank waits in the same collective, which "
                "the network did not complete")
    lost = any("has exited" in why or why.startswith("raised ") for _, why in culprits)
    lines = [f"{'lost a rank' if lost else 'hang'}: {head}.",
             f"rank {reporter} (host {host}) gave up in step {step} ({phase})"
             f"{' waiting in ' + where if where else ''}: {cause}.",
             f"Stacks of the live ranks and flight recorder: {hang_dir}; heartbeats: "
             f"{beats_dir}"]
    bad_nodes = blamed_nodes(culprits, hosts)
    resumes = (f"it resumes from its last checkpoint ({saved.name})" if saved is not None else
               "no checkpoint was saved yet, so it starts from step 0")
    raised = any(why.startswith("raised ") for _, why in culprits)
    if raised:
        lines.append(f"Fix the error (its traceback is in that rank's log) and resubmit; "
                     f"{resumes}.")
    elif requeues:
        without = f"without {','.join(bad_nodes)}" if bad_nodes else "excluding no node"
        lines.append(f"The job requeues itself {without} unless cluster.max_restarts is "
                     f"reached; {resumes}.")
    elif slurm and bad_nodes:
        nodes = ",".join(bad_nodes)
        lines.append(f"Resubmit without the node: --exclude={nodes} (or cluster.exclude={nodes}); "
                     f"{resumes}.")
    else:
        lines.append(f"Resubmit and {resumes}; if it recurs, raise cluster.timeout_s only when "
                     "a step legitimately takes that long.")
    return "\n".join(lines)


def claim(path: Path, message: str) -> bool:
    """Write `message` to `path` unless another rank did first (atomic create)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(message + "\n")
    return True


def archive_previous(run_dir: Path) -> None:
    """Move the hang folder of an earlier run on this directory to `hang.prev` and drop its
    heartbeats (called by one rank before the others start watching), so a fresh report can be
    claimed and no stale beat names a rank of this run."""
    shutil.rmtree(heartbeat_dir(run_dir), ignore_errors=True)
    current = hang_dir_of(run_dir)
    previous = current.with_name("hang.prev")
    if current.exists():
        shutil.rmtree(previous, ignore_errors=True)
        current.rename(previous)


def recording() -> bool:
    """torch's flight recorder records (TORCH_FR_BUFFER_SIZE > 0, set by `launch.worker`)."""
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0


def flight_recorder() -> bytes | None:
    """torch's flight recorder (recent collectives of every group, with their states and issue
    times) as JSON, when it records."""
    if not recording():
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # private: this one place

        return _dump_fr_trace_json(includeCollectives=True, onlyActive=False)
    except (ImportError, RuntimeError):
        return None


def dump_flight_recorder(path: Path) -> bytes | None:
    """`flight_recorder()`, written to `path` and returned."""
    trace = flight_recorder()
    if trace is None:
        return None
    try:
        path.write_bytes(trace)
    except OSError:
        return None
    return trace


def last_collective(trace: bytes | None) -> str | None:
    """The newest collective in a flight-recorder dump, e.g. "gloo:all_reduce on the dp group
    (#43)" (on gloo the recorder does not mark which one is pending: the newest is the one this
    rank issued last)."""
    try:
        entry = json.loads(trace)["entries"][-1]
        pg = entry["process_group"]
        name = {"default_pg": "world", "": f"#{pg[0]}", "undefined": f"#{pg[0]}"}.get(pg[1], pg[1])
        return f"{entry['profiling_name']} on the {name} group (#{entry['collective_seq_id']})"
    except (TypeError, ValueError, KeyError, IndexError):
        return None

"""NCCL point-to-point: consecutive SEND/RECV actions go out as one batched group.

NCCL matches sends and receives by their order per (src, dst) pair — tags are ignored — and a
send kernel waits on its stream until the peer posts the matching receive. Two neighbours that
both send before they receive (1F1B's steady state: activations one way, gradients the other)
would wait on each other. Issuing every maximal run of consecutive communication actions of a
rank as one `batch_isend_irecv` group lets both directions progress together.

`check_batched` verifies a lowered schedule under exactly those rules, without processes: the
k-th send a→b must be the k-th receive on b from a, and when each rank posts its next group only
after its previous group completed, every group completes (no deadlock).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hpctrain.parallel.pipeline.actions import Action, ActionKind, Schedule
from hpctrain.parallel.pipeline.lowering import message_key

K = ActionKind
Op = tuple[str, int, int, int]  # ("send" | "recv", peer rank, ordinal on that pair, message id)


def comm_groups(actions: Sequence[Action]) -> list[Action | tuple[Action, ...]]:
    """Compute actions as they are; each maximal run of SEND/RECV actions as one tuple."""
    out: list[Action | tuple[Action, ...]] = []
    run: list[Action] = []
    for a in actions:
        if a.kind.is_compute:
            if run:
                out.append(tuple(run))
                run = []
            out.append(a)
        else:
            run.append(a)
    if run:
        out.append(tuple(run))
    return out


def _peer_stage(a: Action) -> int:
    return a.stage + 1 if a.kind in (K.SEND_F, K.RECV_B) else a.stage - 1


def _ops(schedule: Schedule) -> list[list[list[Op]]]:
    """Per rank, per communication group: its ops with their per-pair ordinals."""
    seen: Counter = Counter()
    out = []
    for rank, actions in enumerate(schedule.actions):
        groups = []
        for item in comm_groups(actions):
            if isinstance(item, Action):
                continue
            ops = []
            for a in item:
                peer = schedule.stage_to_rank[_peer_stage(a)]
                kind = "send" if a.kind in (K.SEND_F, K.SEND_B) else "recv"
                pair = (rank, peer) if kind == "send" else (peer, rank)
                ops.append((kind, peer, seen[kind, pair], hash(message_key(a))))
                seen[kind, pair] += 1
            groups.append(ops)
        out.append(groups)
    return out


def _matches(ops_by_rank, rank: int, op: Op) -> dict:
    """Where the partner of `op` sits: {(peer rank, group index)} for its ordinal."""
    kind, peer, k, _ = op
    want = "recv" if kind == "send" else "send"
    for g, ops in enumerate(ops_by_rank[peer]):
        for kind2, peer2, k2, msg in ops:
            if kind2 == want and peer2 == rank and k2 == k:
                return {"group": g, "message": msg}
    raise ValueError(f"rank {rank}: {kind} #{k} with rank {peer} has no partner")


def check_batched(schedule: Schedule) -> None:
    """ValueError when NCCL-style matching pairs different messages or deadlocks."""
    ops = _ops(schedule)
    need = []  # per rank, per group: the peer groups that must be posted for it to complete
    for rank, groups in enumerate(ops):
        need.append([])
        for g, group in enumerate(groups):
            deps = set()
            for op in group:
                partner = _matches(ops, rank, op)
                if partner["message"] != op[3]:
                    raise ValueError(f"schedule {schedule.name!r}: rank {rank} group {g}: "
                                     f"{op[0]} #{op[2]} with rank {op[1]} pairs different "
                                     "messages under order matching")
                deps.add((op[1], partner["group"]))
            need[rank].append(deps)
    posted = [0] * len(ops)  # index of the group each rank has posted (and waits on)
    while any(posted[r] < len(ops[r]) for r in range(len(ops))):
        progress = False
        for r in range(len(ops)):
            if posted[r] < len(ops[r]) and all(posted[p] >= g for p, g in need[r][posted[r]]):
                posted[r] += 1
                progress = True
        if not progress:
            stuck = {r: posted[r] for r in range(len(ops)) if posted[r] < len(ops[r])}
            raise ValueError(f"schedule {schedule.name!r} deadlocks with batched p2p: "
                             f"ranks waiting at groups {stuck}")

"""`bench=p2p`: latency and bandwidth of every ordered pair of ranks over tagged send/recv.

Pairs run in the rounds of a round-robin tournament (circle method): n − 1 rounds for n ranks
(n odd: one rank rests each round), each round a set of disjoint pairs measured concurrently,
with a barrier between rounds. For each ordered pair src → dst:

    latency   = half the round trip of a `min_bytes` ping-pong initiated by src
    bandwidth = iters × max_bytes / (time for src to stream them to dst, plus dst's 1-element
                acknowledgement, so a send that returns early is not counted as delivered)

The n × n bandwidth matrix (report.py draws it) shows one bad link as one cold cell pair, a bad
NIC or node as a cold row and column.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.bench.timing import TORCH_DTYPES, node_name, slow_factor_for, stem, timed
from hpctrain.config.bench import BenchConfig
from hpctrain.distributed.mesh import Mesh

TAG_PING, TAG_STREAM, TAG_ACK = 101, 102, 103


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint (low, high) pairs covering every pair of range(n) exactly once."""
    m = n + n % 2  # an odd world gets a phantom rank m − 1: its partner rests that round
    order = list(range(m))
    rounds = []
    for _ in range(m - 1):
        pairs = [(order[i], order[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(p), max(p)) for p in pairs if max(p) < n])
        order = [order[0], order[-1], *order[1:-1]]
    return rounds


def _buffer(nbytes: int, dtype, device) -> torch.Tensor:
    elem = torch.tensor([], dtype=dtype).element_size()
    return torch.zeros(max(1, nbytes // elem), dtype=dtype, device=device)


def _ping_pong(buf, peer: int, *, initiator: bool):
    def op():
        if initiator:
            dist.send(buf, peer, tag=TAG_PING)
            dist.recv(buf, peer, tag=TAG_PING)
        else:
            dist.recv(buf, peer, tag=TAG_PING)
            dist.send(buf, peer, tag=TAG_PING)
    return op


def _stream(buf, peer: int, *, sender: bool, b: BenchConfig, mesh: Mesh, slow: float) -> float:
    """Seconds to move `iters` buffers src → dst, acknowledgement included (as seen by src)."""
    ack = torch.zeros(1, dtype=buf.dtype, device=buf.device)
    op = ((lambda: dist.send(buf, peer, tag=TAG_STREAM)) if sender
          else (lambda: dist.recv(buf, peer, tag=TAG_STREAM)))
    per_op = timed(op, iters=b.iters, warmup=b.warmup, device=mesh.device, slow_factor=slow)
    t0 = time.perf_counter()
    (dist.recv if sender else dist.send)(ack, peer, tag=TAG_ACK)
    return per_op * b.iters + (time.perf_counter() - t0)


def _direction(src: int, dst: int, b: BenchConfig, mesh: Mesh, slow: float,
               nodes: list[str]) -> dict[str, Any] | None:
    """Measure src → dst on both ends; the record comes from src."""
    me, dtype = mesh.rank, TORCH_DTYPES[b.dtype]
    peer = dst if me == src else src
    small = _buffer(b.min_bytes, dtype, mesh.device)
    rtt = timed(_ping_pong(small, peer, initiator=me == src), iters=b.iters, warmup=b.warmup,
                device=mesh.device, slow_factor=slow)
    big = _buffer(b.max_bytes, dtype, mesh.device)
    seconds = _stream(big, peer, sender=me == src, b=b, mesh=mesh, slow=slow)
    if me != src:
        return None
    nbytes, small_bytes = big.numel() * big.element_size(), small.numel() * small.element_size()
    return stem("p2p", rank=me, node=nodes[me], src=src, dst=dst, src_node=nodes[src],
                dst_node=nodes[dst], bytes=nbytes, latency_bytes=small_bytes,
                latency_s=rtt / 2, bw_GBps=b.iters * nbytes / seconds / 1e9)


def run_p2p(b: BenchConfig, mesh: Mesh) -> list[dict[str, Any]]:
    """Both directions of every pair this rank belongs to; records for the pairs it sends on."""
    world = dist.get_world_size()
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, node_name())
    slow = slow_factor_for(b, rank=mesh.rank, node=nodes[mesh.rank])
    records = []
    for pairs in round_robin(world):
        for lo, hi in pairs:
            if mesh.rank in (lo, hi):
                for src, dst in ((lo, hi), (hi, lo)):
                    rec = _direction(src, dst, b, mesh, slow, nodes)
                    records += [rec] if rec else []
        dist.barrier()
    return records

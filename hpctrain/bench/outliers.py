"""Who is slow? Relative scores per rank, node and link from benchmark records (pure).

A score is a measurement divided by the median of its peers, so a healthy cluster scores ~1
everywhere whatever the hardware. Anything below `fraction` (bench.outlier_fraction) is named:

- gemm: per rank, the median over (shape, precision) of TFLOP/s ÷ that key's median over ranks;
  a node is as slow as its slowest rank.
- p2p: links are compared only with links of the same kind (intra-node with intra-node,
  inter-node with inter-node: NVLink and InfiniBand differ by design). A rank or node scores the
  median of its links' bandwidth ÷ the median of all links of that kind, so one bad NIC drags
  every link of its node while one bad cable shows up only as a slow link (reported, not used
  to exclude a node: either end could be at fault).

Scores need peers: with two ranks a link cannot be pinned on either end.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Finding:
    bench: str  # gemm | p2p
    level: str  # rank | node | link
    name: str  # "rank 3", "node gpu07", "link 2→5 (inter-node)"
    nodes: tuple[str, ...]  # nodes a --exclude would drop (empty for a link)
    score: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def gemm_rank_scores(records: list[dict]) -> dict[int, float]:
    by_key: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in records:
        if r.get("bench") == "gemm":
            by_key[(r["kind"], r["shape"], r["precision"])][r["rank"]] = r["tflops"]
    ratios: dict[int, list[float]] = defaultdict(list)
    for per_rank in by_key.values():
        med = statistics.median(per_rank.values())
        for rank, value in per_rank.items():
            ratios[rank].append(value / med if med > 0 else 1.0)
    return {rank: statistics.median(v) for rank, v in sorted(ratios.items())}


def _gemm_findings(records: list[dict], fraction: float) -> list[Finding]:
    node_of = {r["rank"]: r["node"] for r in records if r.get("bench") == "gemm"}
    return [Finding("gemm", "rank", f"rank {rank}", (node_of[rank],), score)
            for rank, score in gemm_rank_scores(records).items() if score < fraction]


def _links(records: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("bench") == "p2p":
            kinds["intra-node" if r["src_node"] == r["dst_node"] else "inter-node"].append(r)
    return kinds


def link_scores(links: list[dict]) -> tuple[dict[int, float], dict[str, float]]:
    """(rank → score, node → score) for links of one kind."""
    med = statistics.median(r["bw_GBps"] for r in links)
    by_rank, by_node = defaultdict(list), defaultdict(list)
    for r in links:
        for rank in {r["src"], r["dst"]}:
            by_rank[rank].append(r["bw_GBps"])
        for node in {r["src_node"], r["dst_node"]}:
            by_node[node].append(r["bw_GBps"])
    score = lambda values: statistics.median(values) / med if med > 0 else 1.0  # noqa: E731
    return ({k: score(v) for k, v in sorted(by_rank.items())},
            {k: score(v) for k, v in sorted(by_node.items())})


def _p2p_findings(records: list[dict], fraction: float) -> list[Finding]:
    found = []
    for kind, links in _links(records).items():
        med = statistics.median(r["bw_GBps"] for r in links)
        node_of = {r["src"]: r["src_node"] for r in links}
        node_of |= {r["dst"]: r["dst_node"] for r in links}
        ranks, nodes = link_scores(links)
        found += [Finding("p2p", "rank", f"rank {k} ({kind})", (node_of[k],), s)
                  for k, s in ranks.items() if s < fraction]
        if kind == "inter-node":
            found += [Finding("p2p", "node", f"node {k}", (k,), s)
                      for k, s in nodes.items() if s < fraction]
        found += [Finding("p2p", "link", f"link {r['src']}→{r['dst']} ({kind})", (),
                          r["bw_GBps"] / med) for r in links if med > 0
                  and r["bw_GBps"] / med < fraction]
    return found


def find_outliers(records: list[dict], *, fraction: float) -> list[Finding]:
    """Every rank, node and link scoring below `fraction` of its peers' median."""
    return _gemm_findings(records, fraction) + _p2p_findings(records, fraction)


def nodes_to_exclude(findings: list[Finding]) -> list[str]:
    return sorted({n for f in findings for n in f.nodes})


def exclude_line(nodes: list[str]) -> str | None:
    """The sbatch flag to paste (None when every node looks healthy)."""
    return f"--exclude={','.join(nodes)}" if nodes else None

"""Per-rank records → the rows a person reads: one row per measurement, worst rank shown.

A collective finishes when its slowest rank does, so a comm row takes the longest time over the
group's ranks (the lowest bandwidth); a gemm row shows the median over ranks and the slowest.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any


def comm_rows(records: list[dict]) -> list[dict[str, Any]]:
    """(collective, group instance, bytes) → slowest rank's time and bandwidths; all correct?"""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("bench") == "comm" and r.get("supported"):
            groups[(r["collective"], r["group"], tuple(r["group_ranks"]), r["bytes"])].append(r)
    rows = []
    for (collective, group, ranks, nbytes), rs in groups.items():
        worst = max(rs, key=lambda r: r["time_s"])
        rows.append({"collective": collective, "group": group, "ranks": list(ranks),
                     "bytes": nbytes, "time_s": worst["time_s"], "algbw_GBps": worst["algbw_GBps"],
                     "busbw_GBps": worst["busbw_GBps"], "correct": all(r["correct"] for r in rs),
                     "n": worst["n"]})
    return sorted(rows, key=lambda r: (r["group"], r["ranks"], r["collective"], r["bytes"]))


def unsupported(records: list[dict]) -> list[dict]:
    seen = {(r["collective"], r["group"]): r for r in records
            if r.get("bench") == "comm" and not r.get("supported", True)}
    return list(seen.values())


def p2p_matrix(records: list[dict], key: str = "bw_GBps") -> tuple[int, list[list[float | None]]]:
    """(n, matrix[src][dst]) of `key` over the p2p records; None on the diagonal."""
    links = [r for r in records if r.get("bench") == "p2p"]
    n = 1 + max((max(r["src"], r["dst"]) for r in links), default=-1)
    matrix: list[list[float | None]] = [[None] * n for _ in range(n)]
    for r in links:
        matrix[r["src"]][r["dst"]] = r[key]
    return n, matrix


def node_pairs(records: list[dict]) -> list[dict[str, Any]]:
    """Per (src node, dst node): median and minimum bandwidth, median latency over rank pairs."""
    pairs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        if r.get("bench") == "p2p":
            pairs[(r["src_node"], r["dst_node"])].append(r)
    return [{"src_node": a, "dst_node": b, "links": len(rs),
             "median_bw_GBps": statistics.median(r["bw_GBps"] for r in rs),
             "min_bw_GBps": min(r["bw_GBps"] for r in rs),
             "median_latency_s": statistics.median(r["latency_s"] for r in rs)}
            for (a, b), rs in sorted(pairs.items())]


def gemm_rows(records: list[dict]) -> list[dict[str, Any]]:
    """Per (kind, shape, precision): median TFLOP/s over ranks, the slowest rank, the peak."""
    keys: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("bench") == "gemm":
            keys[(r["precision"], r["kind"], r["m"] * r["k"] * r["n"], r["shape"])].append(r)
    rows = []
    for (precision, kind, _, shape), rs in sorted(keys.items()):
        slowest = min(rs, key=lambda r: r["tflops"])
        med = statistics.median(r["tflops"] for r in rs)
        peak = rs[0]["peak_tflops"]
        rows.append({"precision": precision, "kind": kind, "shape": shape, "m": rs[0]["m"],
                     "k": rs[0]["k"], "n": rs[0]["n"], "median_tflops": med,
                     "min_tflops": slowest["tflops"], "min_rank": slowest["rank"],
                     "peak_tflops": peak, "fraction_of_peak": None if peak is None else med / peak})
    return rows

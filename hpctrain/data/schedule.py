"""Which corpus each global sample of a mixture comes from (data.mixture, data.stages): a pure
function of (seed, sample index), so resume is bit-identical at any dp size.

Legend: g the global sample index (step s holds g ∈ [s·G, (s+1)·G), G = global batch), S corpora
with weights w_i (W = Σ w_i), q = 2^61 − 1, A = ⌊q·(√5 − 1)/2⌋, D a seeded offset in [0, q).
Sample g has the point x_g = (g·A + D) mod q: a Weyl sequence with the golden ratio's step, the
most evenly spread sequence there is (any n consecutive points fill every interval of [0, q)
to within O(log n) points of its share). Corpus i owns [c_{i−1}, c_i) with
c_i = ⌊q · Σ_{k≤i} w_k / W⌋, so over any window of n samples corpus i gets n·w_i/W samples up to
O(log n) — per step, not only on average. How many samples of corpus i precede g is a count of
points in an interval, a difference of floor sums Σ_{k<n} ⌊(a·k + b)/m⌋ computed exactly in
O(log q) (`floor_sum`): no state, no replay from step 0.

Stages (data.stages) change the weights from a given sample on; the points stay the same and
only the intervals change, so a corpus's count adds up over the stages. Within corpus i (n_i
samples) the j-th sample drawn is sample order_e[j mod n_i] of epoch e = ⌊j / n_i⌋, order_e a
permutation seeded by (seed, i, e): a corpus that runs out starts its next epoch in a fresh
order, independently of the others.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction
from functools import lru_cache

import numpy as np
import torch

Q = (1 << 61) - 1
A = (math.isqrt(5 * Q * Q) - Q) // 2  # ⌊q·(√5 − 1)/2⌋


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """Σ_{k=0}^{n−1} ⌊(a·k + b) / m⌋ for n ≥ 0, m ≥ 1, a ≥ 0, b ≥ 0 (Euclid-like, exact)."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def _below(n: int, offset: int, c: int) -> int:
    """#{k < n : (k·A + offset) mod q < c}, 0 ≤ c ≤ q: 1[y mod q < c] = ⌊y/q⌋ − ⌊(y − c)/q⌋."""
    return floor_sum(n, Q, A, offset) - floor_sum(n, Q, A, offset - c + Q) + n


def cuts(weights: list[float]) -> list[int]:
    """[c_0 .. c_S]: corpus i owns points [c_i, c_{i+1}) of [0, q) (exact in the weights)."""
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    if total <= 0 or min(exact) < 0:
        raise ValueError(f"mixture weights {weights} must be ≥ 0 with a positive sum")
    acc, out = Fraction(0), [0]
    for w in exact:
        acc += w
        out.append(int(acc * Q // total))
    return out


def seeded_offset(seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"hpctrain mixture {seed}".encode()).digest()[:8],
                          "little") % Q


class MixtureSchedule:
    """The corpus of each global sample and how many of each corpus precede it (module doc).

    `stages`: (first global sample, weights) pairs, the first at sample 0, in increasing order.
    """

    def __init__(self, stages: list[tuple[int, list[float]]], *, seed: int):
        if not stages or stages[0][0] != 0:
            raise ValueError("the first stage of a mixture schedule starts at sample 0")
        self.starts = [start for start, _ in stages]
        self.cuts = [cuts(weights) for _, weights in stages]
        self.n_sources = len(stages[0][1])
        self.offset = seeded_offset(seed)

    def _stage(self, g: int) -> int:
        return int(np.searchsorted(self.starts, g, side="right")) - 1

    def source(self, g: int) -> int:
        """The corpus of global sample g."""
        x = (g * A + self.offset) % Q
        c = self.cuts[self._stage(g)]
        return int(np.searchsorted(c, x, side="right")) - 1

    def drawn(self, g: int) -> list[int]:
        """Samples of each corpus among global samples [0, g)."""
        counts = [0] * self.n_sources
        for k, start in enumerate(self.starts):
            if start >= g:
                break
            end = min(g, self.starts[k + 1]) if k + 1 < len(self.starts) else g
            # points of samples [start, end): k·A + offset shifted to start at 0
            offset = (start * A + self.offset) % Q
            below = [_below(end - start, offset, c) for c in self.cuts[k]]
            for i in range(self.n_sources):
                counts[i] += below[i + 1] - below[i]
        return counts


@lru_cache(maxsize=16)
def epoch_order(n: int, seed: int, source: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of the n samples of corpus `source`."""
    digest = hashlib.sha256(f"hpctrain order {seed} {source} {epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(n, generator=gen).numpy()


class MixtureSampler:
    """`Sampler`'s interface over a mixture: corpus i's samples are the dataset's indices
    [first_i, first_i + n_i); `rows(g0, g1)` gives (corpus, dataset index) of global samples
    [g0, g1)."""

    def __init__(self, schedule: MixtureSchedule, *, firsts: list[int], counts: list[int],
                 seed: int, global_batch: int, dp: int, micro_batch: int):
        self.schedule, self.firsts, self.counts, self.seed = schedule, firsts, counts, seed
        self.global_batch, self.dp, self.micro_batch = global_batch, dp, micro_batch

    def rows(self, g0: int, g1: int) -> list[tuple[int, int]]:
        drawn = self.schedule.drawn(g0)
        out = []
        for g in range(g0, g1):
            i = self.schedule.source(g)
            epoch, j = divmod(drawn[i], self.counts[i])
            drawn[i] += 1
            out.append((i, self.firsts[i] + int(epoch_order(self.counts[i], self.seed, i,
                                                            epoch)[j])))
        return out

    def micro_rows(self, step: int, *, dp_rank: int, micro: int) -> list[tuple[int, int]]:
        """(corpus, dataset index) of each row of micro-batch `micro` of rank `dp_rank`."""
        per_rank = self.global_batch // self.dp
        first = step * self.global_batch + dp_rank * per_rank + micro * self.micro_batch
        return self.rows(first, first + self.micro_batch)

    def indices(self, step: int, *, dp_rank: int, micro: int) -> list[int]:
        return [index for _, index in self.micro_rows(step, dp_rank=dp_rank, micro=micro)]

    def epochs(self, step: int) -> list[float]:
        """Epochs of each corpus completed after `step` (fractional: drawn / n_i)."""
        drawn = self.schedule.drawn((step + 1) * self.global_batch)
        return [d / n for d, n in zip(drawn, self.counts, strict=True)]

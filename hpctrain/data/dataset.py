"""Token batches from a prepared memmap, sharded by data-parallel rank, exactly resumable.

Samples are non-overlapping windows of seq_len+1 tokens. Epoch e visits them in the order of a
permutation seeded by (seed, e). The global batch of step s is samples [s·G, (s+1)·G) of that
infinite stream; data-parallel rank d takes the d-th contiguous slice of G/dp samples and splits
it into micro-batches. The sampler is a pure function of (seed, step): its whole state is the
step, so resuming — at any dp size — reproduces the stream exactly.

With data.packing=documents a window's documents are masked from each other (boundaries at the
end-of-document token, `Documents.from_eod`); with train.batching=tokens the samples are rows of
whole documents instead (hpctrain.data.packing), drawn by the same sampler.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from hpctrain.data.packing import PackedDocuments
from hpctrain.data.sources import numbered, split_sources
from hpctrain.ops.documents import Documents


class TokenDataset:
    """Windows of seq_len+1 tokens; `rows(indices)` gives a micro-batch (packing: "none" |
    "documents", see the module doc)."""

    def __init__(self, directory: Path, split: str, *, seq_len: int, packing: str = "none"):
        meta = json.loads((directory / "meta.json").read_text())
        self.vocab_size, self.eod = meta["vocab_size"], meta["eod"]
        self.documents = meta.get(f"{split}_documents")  # eod tokens in the split, if recorded
        self.tokens = np.memmap(directory / f"{split}.bin", dtype=meta["dtype"], mode="r")
        self.seq_len, self.packing = seq_len, packing
        self.n_samples = (len(self.tokens) - 1) // seq_len
        if self.n_samples < 1:
            raise ValueError(f"{directory}/{split}.bin holds {len(self.tokens)} tokens, fewer "
                             f"than train.seq_len+1={seq_len + 1}: add data or lower seq_len")
        self.sources = split_sources(meta, split)
        if self.sources is not None:
            self.sources = numbered(self.sources, [(s.hi - s.lo - 1) // seq_len
                                                   for s in self.sources],
                                    where=f"{directory}/{split}.bin",
                                    need=f"train.seq_len+1={seq_len + 1} tokens")
            self.n_samples = sum(s.count for s in self.sources)
            self._firsts = [s.first for s in self.sources]

    def start(self, index: int) -> int:
        """The first token of sample `index` (within its corpus's range for a mixture)."""
        if self.sources is None:
            return index * self.seq_len
        s = self.sources[int(np.searchsorted(self._firsts, index, side="right")) - 1]
        return s.lo + (index - s.first) * self.seq_len

    def sample(self, index: int) -> np.ndarray:
        start = self.start(index)
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def real_tokens(self, index: int) -> int:
        """Targets of sample `index` that count in the loss (a window has no padding)."""
        return self.seq_len

    def rows(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, Documents | None]:
        """inputs_BL, targets_BL and their documents (None without packing)."""
        inputs_BL, targets_BL = batch(self, indices)
        docs = Documents.from_eod(inputs_BL, eod=self.eod) if self.packing == "documents" else None
        return inputs_BL, targets_BL, docs


def open_split(directory: Path, split: str, *, seq_len: int, packing: str, batching: str):
    """The dataset of one split: windows (`TokenDataset`, batching=rows) or rows of whole
    documents (`hpctrain.data.packing.PackedDocuments`, batching=tokens)."""
    ds = TokenDataset(directory, split, seq_len=seq_len, packing=packing)
    if batching == "rows":
        return ds
    return PackedDocuments(directory, split, seq_len=seq_len, tokens=ds.tokens, eod=ds.eod,
                           count=ds.documents, sources=split_sources(
                               json.loads((directory / "meta.json").read_text()), split))


@lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed * 7919 + epoch)
    return torch.randperm(n, generator=gen).numpy()


class Sampler:
    """Which sample indices make up (step, dp rank, micro-batch)."""

    def __init__(self, n_samples: int, *, seed: int, global_batch: int, dp: int, micro_batch: int):
        self.n, self.seed = n_samples, seed
        self.global_batch, self.dp, self.micro_batch = global_batch, dp, micro_batch

    def indices(self, step: int, *, dp_rank: int, micro: int) -> list[int]:
        per_rank = self.global_batch // self.dp
        first = step * self.global_batch + dp_rank * per_rank + micro * self.micro_batch
        out = []
        for g in range(first, first + self.micro_batch):
            epoch, i = divmod(g, self.n)
            out.append(int(_epoch_order(self.n, self.seed, epoch)[i]))
        return out


def batch(ds: TokenDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs_BL, targets_BL (targets are inputs shifted by one token)."""
    seqs = torch.from_numpy(np.stack([ds.sample(i) for i in indices]))
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

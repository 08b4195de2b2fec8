"""What a rank trains and evaluates on: the prepared splits, the sampler and, for a mixture,
each corpus's share of every step and its own evaluation set.

One corpus: `Sampler` (hpctrain.data.dataset). A mixture (data.mixture, or a prepared directory
whose meta.json records corpora): `MixtureSampler` with the weights of data.mixture, changed by
data.stages from their steps on (hpctrain.data.schedule); a prepared directory read as
data=tokens draws its corpora in proportion to their train samples unless data.stages weighs
them. Stage boundaries are in data steps (the step, plus the steps a non-finite rollback
skipped). Each corpus is evaluated on the first train.eval_samples samples of its val range
(`eval_sets`); eval_loss is then the mean of the corpora's eval losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctrain.config.schema import Config, corpus_name
from hpctrain.data.dataset import Sampler, open_split
from hpctrain.data.schedule import MixtureSampler, MixtureSchedule
from hpctrain.data.sources import Source
from hpctrain.train.eval_set import eval_indices


def stage_weights(cfg: Config, sources: list[Source]) -> list[tuple[int, list[float]]]:
    """(first global sample, weights in the order of `sources`) of each stage."""
    d, gbs = cfg.data, cfg.train.global_batch_size
    names = [s.name for s in sources]
    if not d.stages:
        if d.mixture:
            return [(0, [c.weight for c in d.mixture])]
        return [(0, [float(s.count) for s in sources])]
    out, start = [], 0
    for stage in d.stages:
        unknown = sorted(set(stage.mixture) - set(names))
        if unknown:
            raise ValueError(f"data.stages names corpora {unknown} that the prepared data does "
                             f"not hold (it holds {names})")
        out.append((start, [float(stage.mixture.get(n, 0.0)) for n in names]))
        start = stage.until_step * gbs
    return out


class Feed:
    """The splits and sampler of one rank (module doc); `dp_rank`: its data-parallel index."""

    def __init__(self, cfg: Config, data_dir: Path, *, dp_rank: int):
        t = cfg.train
        self.cfg, self.dp_rank = cfg, dp_rank
        kw = dict(seq_len=t.seq_len, packing=cfg.data.packing, batching=t.batching)
        self.train_ds = open_split(data_dir, "train", **kw)
        self.val_ds = open_split(data_dir, "val", **kw)
        sizes = dict(seed=t.seed, dp=cfg.parallel.dp, global_batch=t.global_batch_size,
                     micro_batch=t.micro_batch_size)
        self.sources = self.train_ds.sources or []
        if not self.sources:
            self.sampler = Sampler(self.train_ds.n_samples, **sizes)
            return
        if cfg.data.mixture:  # the names meta.json records are the config's
            assert [s.name for s in self.sources] == [corpus_name(c, i) for i, c in
                                                     enumerate(cfg.data.mixture)]
        schedule = MixtureSchedule(stage_weights(cfg, self.sources), seed=t.seed)
        self.sampler = MixtureSampler(schedule, firsts=[s.first for s in self.sources],
                                      counts=[s.count for s in self.sources], **sizes)

    def micro_batches(self, data_step: int) -> tuple[list, list[list[int]] | None]:
        """This rank's micro-batches of the step that reads data step `data_step`, and for a
        mixture the corpus of each of their rows (else None)."""
        if not self.sources:
            return [self.train_ds.rows(self.sampler.indices(data_step, dp_rank=self.dp_rank,
                                                            micro=m))
                    for m in range(self.cfg.grad_accum)], None
        rows = [self.sampler.micro_rows(data_step, dp_rank=self.dp_rank, micro=m)
                for m in range(self.cfg.grad_accum)]
        return ([self.train_ds.rows([i for _, i in r]) for r in rows],
                [[c for c, _ in r] for r in rows])

    def step_metrics(self, data_step: int) -> dict[str, Any]:
        """A mixture's per-corpus record of the step: `tokens_<name>` (real target tokens of
        the global batch from it) and `epochs_<name>` (its samples drawn so far / its
        samples); {} for one corpus."""
        if not self.sources:
            return {}
        g = data_step * self.cfg.train.global_batch_size
        tokens = [0] * len(self.sources)
        for i, index in self.sampler.rows(g, g + self.cfg.train.global_batch_size):
            tokens[i] += self.train_ds.real_tokens(index)
        epochs = self.sampler.epochs(data_step)
        return {**{f"tokens_{s.name}": n for s, n in zip(self.sources, tokens, strict=True)},
                **{f"epochs_{s.name}": e for s, e in zip(self.sources, epochs, strict=True)}}

    def eval_sets(self) -> list[tuple[str | None, list]]:
        """(corpus name, this dp rank's micro-batches) of each evaluation set: one per corpus
        of a mixture with its own val range, else one (name None) for the val split
        (hpctrain.train.eval_set)."""
        t = self.cfg.train
        ranges = self.val_ds.sources or [Source(None, 0, 0, 0, self.val_ds.n_samples)]
        return [(s.name, [self.val_ds.rows([s.first + i for i in indices])
                          for indices in eval_indices(s.count, samples=t.eval_samples,
                                                      dp=self.cfg.parallel.dp,
                                                      dp_rank=self.dp_rank,
                                                      micro_batch=t.micro_batch_size)])
                for s in ranges]

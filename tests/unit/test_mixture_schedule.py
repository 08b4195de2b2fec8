"""The mixture schedule (hpctrain.data.schedule): each global sample's corpus and its sample
within the corpus are a pure function of (seed, sample index); proportions hold over any window,
stages switch the weights at their step, a corpus that runs out starts a fresh epoch."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hpctrain.data.schedule import MixtureSampler, MixtureSchedule, epoch_order, floor_sum

G = 8  # global batch


def test_floor_sum_equals_the_sum():
    rng = random.Random(0)
    for _ in range(300):
        n, m = rng.randrange(0, 60), rng.randrange(1, 40)
        a, b = rng.randrange(0, 100), rng.randrange(0, 100)
        assert floor_sum(n, m, a, b) == sum((a * k + b) // m for k in range(n))


def test_counts_before_a_sample_equal_counting_the_corpora_drawn():
    schedule = MixtureSchedule([(0, [0.7, 0.2, 0.1]), (400, [0.2, 0.0, 0.8]),
                                (1000, [1, 1, 1])], seed=3)
    drawn = [schedule.source(g) for g in range(1500)]
    for g in (0, 1, 7, 399, 400, 401, 999, 1000, 1499, 1500):
        assert schedule.drawn(g) == [drawn[:g].count(i) for i in range(3)]
    assert 1 not in drawn[400:1000]  # weight 0 in that stage


def test_proportions_over_1000_steps_and_every_10_steps():
    weights = [0.7, 0.2, 0.1]
    schedule = MixtureSchedule([(0, weights)], seed=11)
    steps = 1000
    counts = np.array(schedule.drawn(steps * G))
    assert np.all(np.abs(counts / (steps * G) - weights) < 0.01)
    assert np.all(np.abs(counts - np.array(weights) * steps * G) <= 4)  # far inside 1%
    sources = np.array([schedule.source(g) for g in range(steps * G)])
    for start in range(0, steps * G, 10 * G):  # every 10-step window: within 3 samples
        window = sources[start:start + 10 * G]
        for i, w in enumerate(weights):
            assert abs(np.count_nonzero(window == i) - w * 10 * G) <= 3


def _sampler(dp: int, *, seed: int = 5, counts=(7, 30, 3), stages=None) -> MixtureSampler:
    stages = stages or [(0, [0.5, 0.3, 0.2])]
    firsts = np.cumsum([0, *counts[:-1]]).tolist()
    return MixtureSampler(MixtureSchedule(stages, seed=seed), firsts=firsts,
                          counts=list(counts), seed=seed, global_batch=G, dp=dp, micro_batch=2)


def _step(sampler: MixtureSampler, step: int) -> list[int]:
    return [i for r in range(sampler.dp) for m in range(G // sampler.dp // 2)
            for i in sampler.indices(step, dp_rank=r, micro=m)]


def test_another_dp_and_a_fresh_sampler_read_the_same_samples():
    one, two, four = _sampler(1), _sampler(2), _sampler(4)
    stream = [_step(one, s) for s in range(40)]
    assert [_step(two, s) for s in range(40)] == stream
    epoch_order.cache_clear()  # a resumed process: nothing carried over
    assert [_step(four, s) for s in range(25, 40)] == stream[25:]
    assert [(i, idx) for i, idx in one.rows(200, 208)] == [
        (i, idx) for i, idx in _sampler(1).rows(200, 208)]
    assert _step(_sampler(1, seed=6), 3) != stream[3]


def test_a_corpus_that_runs_out_starts_a_fresh_epoch():
    """Corpus 2 holds 3 samples (indices 37..39): every 3 of its draws are a permutation of
    them, epochs in other orders; epochs() counts drawn / held."""
    sampler = _sampler(1)
    rows = sampler.rows(0, 400 * G // 8)
    small = [idx for i, idx in rows if i == 2]
    epochs = [small[k:k + 3] for k in range(0, len(small) - 2, 3)]
    assert len(epochs) >= 6 and all(sorted(e) == [37, 38, 39] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    step = len(rows) // G - 1
    assert sampler.epochs(step)[2] == pytest.approx(len(small) / 3)


def test_a_stage_switches_the_weights_at_its_step():
    k = 30
    sampler = _sampler(1, stages=[(0, [1.0, 1.0, 0.0]), (k * G, [0.0, 0.0, 1.0])])
    before, after = sampler.rows(0, k * G), sampler.rows(k * G, (k + 20) * G)
    assert {i for i, _ in before} == {0, 1} and {i for i, _ in after} == {2}
    # the corpora keep their place in their epochs across the switch
    assert sampler.schedule.drawn((k + 20) * G) == [
        sum(i == c for i, _ in before + after) for c in range(3)]


def test_samples_and_packed_rows_stay_inside_their_corpus(tmp_path):
    """Corpus a is only 'a' bytes, b only 'b' (documents of several lengths): a window and a
    packed row of corpus i hold its bytes and end-of-document tokens only; the val split's
    corpora are numbered the same way."""
    from hpctrain.config.schema import Corpus
    from hpctrain.data.dataset import open_split
    from hpctrain.data.prepare import prepare
    from hpctrain.data.tokenizer import BYTE_EOD
    from hpctrain.ops.documents import IGNORE_INDEX
    from tests.unit.test_corpus import data_config, jsonl_lines

    for name, n in (("a", 23), ("b", 41)):
        (tmp_path / f"{name}.jsonl").write_bytes(jsonl_lines(
            *[{"text": name * (1 + 7 * k % 29)} for k in range(n)]))
    mixture = tuple(Corpus(paths=(str(tmp_path / f"{c}.jsonl"),), weight=1.0, name=c)
                    for c in "ab")
    out = prepare(data_config(tmp_path, [], format="jsonl", mixture=mixture))
    for batching in ("rows", "tokens"):
        for split in ("train", "val"):
            ds = open_split(out, split, seq_len=8, packing="documents", batching=batching)
            assert [s.name for s in ds.sources] == ["a", "b"]
            assert ds.sources[1].first == ds.sources[0].count
            assert ds.n_samples == ds.sources[0].count + ds.sources[1].count
            for source in ds.sources:
                for index in range(source.first, source.first + source.count):
                    _, targets, _ = ds.rows([index])
                    real = targets[targets != IGNORE_INDEX].tolist()
                    assert set(real) <= {ord(source.name), BYTE_EOD}, (split, index)
                    assert ds.real_tokens(index) == len(real)


def test_a_corpus_too_small_for_one_sample_is_refused_after_prepare(tmp_path):
    from hpctrain.data.checks import check_prepared
    from hpctrain.data.prepare import prepare
    from tests.conftest import make_config
    from tests.unit.test_corpus import jsonl_lines

    (tmp_path / "big.jsonl").write_bytes(jsonl_lines(*[{"text": "x" * 300}] * 20))
    (tmp_path / "tiny.jsonl").write_bytes(jsonl_lines({"text": "tiny"}, {"text": "tiny2"}))
    cfg = make_config(["train=debug", "data=files", "data.format=jsonl",
                       f"data.cache_dir={tmp_path / 'cache'}",
                       f"data.mixture=[{{name: big, paths: [{tmp_path}/big.jsonl], weight: 1}},"
                       f"{{name: tiny, paths: [{tmp_path}/tiny.jsonl], weight: 1}}]"],
                      run_dir=str(tmp_path))
    with pytest.raises(ValueError) as err:
        check_prepared(cfg, prepare(cfg.data))
    text = str(err.value)
    assert "corpus 'tiny' holds 5 tokens in the train split" in text
    assert "corpus 'tiny' holds 6 tokens in the val split" in text and "big" not in text.split(
        "(prepared data")[0]


def test_a_prepared_mixture_read_as_tokens_draws_by_size_or_by_named_stages(tmp_path):
    """data=tokens on a prepared mixture: without stages its corpora are drawn in proportion
    to their train samples; data.stages weighs them by the names meta.json records, and a
    name it does not hold is refused before launch."""
    from hpctrain.data.dataset import open_split
    from hpctrain.data.prepare import prepare
    from hpctrain.train.feed import stage_weights
    from tests.conftest import make_config
    from tests.unit.test_corpus import jsonl_lines

    for name, n in (("a", 30), ("b", 90)):
        (tmp_path / f"{name}.jsonl").write_bytes(jsonl_lines(*[{"text": name * 40}] * n))
    files = make_config(["train=debug", "data=files", "data.format=jsonl", "data.val_fraction=0.2",
                         f"data.cache_dir={tmp_path / 'cache'}",
                         f"data.mixture=[{{name: a, paths: [{tmp_path}/a.jsonl], weight: 1}},"
                         f"{{name: b, paths: [{tmp_path}/b.jsonl], weight: 1}}]"],
                        run_dir=str(tmp_path))
    out = prepare(files.data)
    sources = open_split(out, "train", seq_len=64, packing="none", batching="rows").sources
    tokens = ["train=debug", "data.source=tokens", f"data.paths=[{out}]"]
    by_size = stage_weights(make_config(tokens, run_dir=str(tmp_path)), sources)
    assert by_size == [(0, [float(s.count) for s in sources])]
    assert sources[1].count > sources[0].count
    staged = make_config([*tokens, "data.stages=[{until_step: 5, mixture: {b: 1}}, "
                                   "{until_step: 9, mixture: {a: 2, b: 1}}]"],
                         run_dir=str(tmp_path))
    assert stage_weights(staged, sources) == [(0, [0.0, 1.0]), (5 * 4, [2.0, 1.0])]
    with pytest.raises(ValueError, match=r"data.stages\[0\].mixture names \['c'\], not corpora"):
        make_config([*tokens, "data.stages=[{until_step: 5, mixture: {c: 1}}]"],
                    run_dir=str(tmp_path))

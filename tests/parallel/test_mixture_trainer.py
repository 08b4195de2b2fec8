"""A mixture in the trainer: each step's rows come from the seeded schedule, the per-corpus
loss (loss_<name>), tokens and epochs are logged, each corpus has its own eval loss, a stage
switches the weights at its step; resume is bit-identical, a dp=2 run resumed at dp=1 continues
the same samples, and tp=2, pp=2 and cp=2 give the per-corpus losses of one process."""

from __future__ import annotations

import json
import math

import pytest

from hpctrain.data.prepare import prepare
from tests.conftest import get_world, make_config
from tests.parallel.trainer_runs import run_trainer

STEPS, SWITCH = 4, 3
KEYS = ("loss", "loss_web", "loss_code", "loss_math", "tokens_web", "tokens_code", "tokens_math",
        "epochs_web", "epochs_code", "epochs_math")


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> list[str]:
    """Three corpora of distinct alphabets (prepared once here), 0.5/0.3/0.2 until step 3, then
    code and math only."""
    root = tmp_path_factory.mktemp("mixture")
    corpora = []
    for k, (name, alphabet) in enumerate((("web", "abcdefgh "), ("code", "(){};=+x "),
                                          ("math", "0123456789+-=^ "))):
        lines = [json.dumps({"text": "".join(alphabet[(j * 7 + i * i) % len(alphabet)]
                                             for i in range(30 + (j * 37) % 200))})
                 for j in range(40 + 30 * k)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        corpora.append(f"{{name: {name}, paths: [{root}/{name}.jsonl], weight: {5 - 2 * k}}}")
    overrides = ["data=files", "data.format=jsonl", f"data.mixture=[{','.join(corpora)}]",
                 f"data.stages=[{{until_step: {SWITCH - 1}, mixture: {{web: 5, code: 3, math: 2}}"
                 f"}}, {{until_step: {STEPS}, mixture: {{code: 1, math: 1}}}}]",
                 f"data.cache_dir={root / 'cache'}", "train.eval_every=2"]
    prepare(make_config(overrides, run_dir=str(root)).data)
    return overrides


def _run(overrides: list[str], run_dir: str, steps: int = STEPS):
    trainer = run_trainer(overrides, run_dir, steps=steps)
    return [{k: h.get(k) for k in (*KEYS, "eval_loss", "eval_loss_web", "eval_loss_math")}
            for h in trainer.history]


def _nan_free(history: list[dict]) -> list[dict]:
    """`history` with NaN as "nan", so that == compares every other value exactly."""
    return [{k: "nan" if v != v else v for k, v in h.items()} for h in history]


def _close(got: list[dict], want: list[dict], rel: float = 1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for k, v in w.items():
            if isinstance(v, float) and not math.isnan(v):
                assert g[k] == pytest.approx(v, rel=rel), k
            else:
                assert g[k] == v or (g[k] != g[k] and v != v), k


@pytest.fixture(scope="module")
def reference(mixture, tmp_path_factory):
    return get_world(1).run(_run, mixture, str(tmp_path_factory.mktemp("ref")))[0]


def test_per_corpus_records_and_the_stage_switch(reference):
    for step, h in enumerate(reference, start=1):
        tokens = [h["tokens_web"], h["tokens_code"], h["tokens_math"]]
        assert sum(tokens) == 8 * 64  # the global batch's targets, windows: all real
        mean = sum(t * h[f"loss_{n}"] for t, n in zip(tokens, ("web", "code", "math"),
                                                       strict=True) if t) / sum(tokens)
        assert mean == pytest.approx(h["loss"], rel=1e-6)  # the corpora make up the step
        if step > SWITCH - 1:
            assert h["tokens_web"] == 0 and math.isnan(h["loss_web"])
        else:
            assert min(tokens) > 0
    assert reference[-1]["epochs_web"] == reference[SWITCH - 2]["epochs_web"] > 0
    assert reference[-1]["epochs_math"] > reference[SWITCH - 2]["epochs_math"]
    evaluated = reference[1]
    assert evaluated["eval_loss"] == pytest.approx(
        (evaluated["eval_loss_web"] + evaluated["eval_loss_math"] + _eval_code(reference)) / 3)


def _eval_code(reference) -> float:  # eval_loss_code, recovered from the mean of the three
    h = reference[1]
    return 3 * h["eval_loss"] - h["eval_loss_web"] - h["eval_loss_math"]


def test_resume_is_bit_identical_and_continues_the_same_samples_at_another_dp(
        mixture, reference, world2, tmp_path):
    one = get_world(1)
    run = str(tmp_path / "one")
    one.run(_run, [*mixture, f"train.stop_after={SWITCH - 1}"], run)
    assert _nan_free(one.run(_run, mixture, run)[0]) == _nan_free(reference[SWITCH - 1:])
    run = str(tmp_path / "dp2")
    world2.run(_run, [*mixture, "parallel.dp=2", f"train.stop_after={SWITCH - 1}"], run)
    _close(one.run(_run, mixture, run)[0], reference[SWITCH - 1:])


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"], ["parallel.cp=2"],
                                    ["parallel.dp=2"]], ids=lambda o: o[0].split(".")[1])
def test_every_layout_gives_one_process_per_corpus_losses(mixture, reference, world2, layout,
                                                          tmp_path):
    runs = world2.run(_run, [*mixture, *layout], str(tmp_path / "run"))
    _close(next(r for r in runs if r[0]["tokens_web"] is not None), reference)  # logging rank

"""task=eval: a checkpoint's eval_loss equals the in-training eval at its step (one tiny run
shared by the file); its refusals; eval.json and W&B offline."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from omegaconf import OmegaConf

from hpctrain.dispatch import launch
from hpctrain.metrics.logger import read_jsonl
from tests import wandb_records
from tests.conftest import compose, make_config

# 4 steps, eval and checkpoint every 2: checkpoints at 2 and 4 (the last), eval_loss at 2 and 4.
TRAIN = ["model=debug", "train=debug", "train.steps=4", "train.eval_every=2",
         "train.checkpoint_every=2", "train.eval_samples=6", "train.micro_batch_size=3",
         "train.global_batch_size=6", "optim.warmup_steps=1", "data.max_bytes=200000",
         "logger=none", "logger.progress=plain"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished single-process run with its saved config (as the entry point records it)."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    record = {"config.yaml": yaml.safe_dump(OmegaConf.to_container(compose(TRAIN),
                                                                   resolve=False))}
    launch(make_config(TRAIN, run_dir=run_dir), record=record)
    evals = {r["step"]: r["eval_loss"] for r in read_jsonl(run_dir / "metrics.jsonl")
             if r.get("eval_loss") is not None}
    assert sorted(evals) == [2, 4]
    return run_dir, evals


def _eval(overrides: list[str], run_dir) -> dict:
    return launch(make_config(["task=eval", "logger=none", *overrides], run_dir=run_dir))


def test_eval_of_a_run_equals_its_last_in_training_eval(trained, tmp_path):
    run_dir, evals = trained
    result = _eval([f"eval.from={run_dir}", "eval.device=cpu"], tmp_path)
    assert result["step"] == 4 and result["checkpoint"].endswith("step_00000004")
    assert result["settings_from"] == "run" and result["samples"] == 6
    assert result["eval_loss"] == pytest.approx(evals[4], rel=1e-5)
    assert result["tokens"] == 6 * 64  # train=debug: seq_len 64, every target real
    assert result["eval_perplexity"] == pytest.approx(math.exp(evals[4]), rel=1e-5)
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["eval_loss"] == result["eval_loss"] and saved["step"] == 4


def test_eval_of_an_earlier_checkpoint_equals_the_eval_at_its_step(trained, tmp_path):
    run_dir, evals = trained
    ckpt = run_dir / "checkpoints" / "step_00000002"
    result = _eval([f"eval.from={ckpt}", "eval.micro_batch_size=2"], tmp_path)
    assert result["step"] == 2
    # another micro-batch size regroups the same samples: the token-weighted mean is the same
    assert result["eval_loss"] == pytest.approx(evals[2], rel=1e-5)
    assert abs(evals[2] - evals[4]) > 1e-3  # the two steps are told apart


def test_other_samples_give_another_loss(trained, tmp_path):
    run_dir, evals = trained
    result = _eval([f"eval.from={run_dir}", "eval.samples=3", "eval.micro_batch_size=3"],
                   tmp_path)
    assert result["samples"] == 3 and result["eval_loss"] != pytest.approx(evals[4], rel=1e-5)


def test_more_samples_than_the_split_holds_is_refused_at_once(trained, tmp_path):
    """Issue 45: eval.samples=1000000000 grew to 8.6 GB without output (the indices wrap
    around the split, so the same samples again)."""
    run_dir, _ = trained
    with pytest.raises(ValueError, match=r"eval.samples=1000000000 is more than the \d+ samples "
                                         r"of the val split .*: set eval.samples=\d+"):
        _eval([f"eval.from={run_dir}", "eval.samples=1000000000", "eval.micro_batch_size=2"],
              tmp_path)


def test_eval_logs_to_wandb_offline(trained, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir, evals = trained
    launch(make_config(["task=eval", f"eval.from={run_dir}", "logger.wandb=offline",
                        "logger.progress=plain"], run_dir=tmp_path))
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    rows = wandb_records.history(files[0])
    logged = [r for r in rows if "eval_loss" in r]
    assert len(logged) == 1 and json.loads(logged[0]["_step"]) == 4
    assert json.loads(logged[0]["eval_loss"]) == pytest.approx(evals[4], rel=1e-5)


@pytest.mark.parametrize(("overrides", "message"), [
    ([], r"task=eval needs a model: eval.from=<run directory"),
    (["eval.from=/x", "eval.samples=5", "eval.micro_batch_size=2"],
     r"eval.samples=5 is not a multiple of eval.micro_batch_size=2: use e.g. eval.samples=4"),
    (["eval.from=/x", "eval.samples=0"], r"nothing to evaluate"),
    (["eval.from=/x", "eval.lm_eval_include_path=/nonexistent", "eval.lm_eval_tasks=[t]"],
     r"eval.lm_eval_include_path=/nonexistent: no such directory"),
    (["eval.from=/x", "eval.lm_eval_include_path=/tmp"], r"eval.lm_eval_tasks is empty"),
    (["eval.from=/x", "+eval.sample=3"], r"eval.sample"),
    (["eval.from=/x", "cluster=slurm"], r"task=eval runs in one process.*procs_per_node=1"),
])
def test_eval_refusals_name_the_keys(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        make_config(["task=eval", *overrides], run_dir=tmp_path)


def test_eval_from_and_init_from_contradict(tmp_path):
    pytest.importorskip("transformers")
    from tests.hf_models import save_tiny_llama

    save_tiny_llama(tmp_path / "hf", tied=False)
    with pytest.raises(ValueError, match=r"eval.from=/x and model.init_from=.* both name the "
                       r"model: keep one"):
        make_config(["task=eval", "eval.from=/x", "model=hf",
                     f"model.init_from={tmp_path / 'hf'}"], run_dir=tmp_path)


def test_eval_data_run_needs_a_saved_config(trained, tmp_path):
    """A checkpoint copied out of its run has no saved settings: eval.data=run says so."""
    import shutil

    run_dir, _ = trained
    copy = tmp_path / "r" / "checkpoints" / "step_00000002"
    shutil.copytree(run_dir / "checkpoints" / "step_00000002", copy)
    with pytest.raises(ValueError, match=r"eval.data=run, but .* no run directory with a saved"):
        _eval([f"eval.from={copy}", "eval.data=run"], tmp_path)

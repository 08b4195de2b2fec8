"""NaN/Inf guard (train.on_nonfinite): stop, skip and rollback, single process, dp=2 and pp=2.

Two real ways to make a step non-finite:
- a huge learning rate (optim.lr=1e4, no clipping, no warm-up): the second step's gradient norm
  is NaN, deterministically;
- a poisoned batch: one micro-batch's loss value is NaN while its gradients stay finite (the
  loss plus a NaN constant: a fault in the loss that autograd cannot see). Only the loss is
  non-finite, and only on the rank that reads that batch, so the verdict must travel to the
  other ranks through the norm's all-reduce. (A fully padded micro-batch no longer does it:
  its weight in the step's token mean is zero, and its loss is 0.)
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from hpctrain import dispatch
from hpctrain.data.dataset import Sampler, TokenDataset
from hpctrain.errors import NonFiniteError
from hpctrain.metrics.logger import read_jsonl
from hpctrain.ops.documents import IGNORE_INDEX
from hpctrain.parallel.step import lm_loss
from tests.conftest import ROOT, make_config

SMALL = ["model=debug", "train=debug", "data.max_bytes=200000", "logger.wandb=disabled",
         "logger.progress=plain", "train.eval_every=0", "optim.warmup_steps=1"]
BLOW_UP = ["optim.lr=1e4", "train.grad_clip=0", "optim.warmup_steps=0"]  # step 2: NaN norm


def _nan_loss_on_marked(loss_fn):
    """loss_fn, but NaN-valued (gradients unchanged) on a micro-batch whose rows all start
    with an ignored target: the mark `poisoned` puts on its batch (real rows never do)."""
    def loss(logits, targets):
        out = loss_fn(logits, targets)
        if bool((targets[:, 0] == IGNORE_INDEX).all()):
            return out + float("nan") * out.detach()
        return out

    return loss


@contextlib.contextmanager
def poisoned(data_step: int, *, global_batch: int, dp: int, micro_batch: int = 2,
             seed: int = 1234):
    """dp rank 0's first micro-batch of `data_step` (0-based) has a NaN loss and finite
    gradients, in the engine's step and on a pipeline's last stage."""
    real = TokenDataset.rows

    def rows(ds, indices):
        inputs, targets, docs = real(ds, indices)
        sampler = Sampler(ds.n_samples, seed=seed, global_batch=global_batch, dp=dp,
                          micro_batch=micro_batch)
        if (str(ds.tokens.filename).endswith("train.bin")
                and indices == sampler.indices(data_step, dp_rank=0, micro=0)):
            targets = targets.clone()
            targets[:, 0] = IGNORE_INDEX
        return inputs, targets, docs

    bad = _nan_loss_on_marked(lm_loss)
    with (mock.patch.object(TokenDataset, "rows", rows),
          mock.patch("hpctrain.parallel.data.engine.lm_loss", bad),
          mock.patch("hpctrain.train.tensor_parallel.lm_loss", bad)):  # the pipeline's
        yield


def _all_finite(checkpoint: Path, tmp: Path) -> bool:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(tmp / "ck.pt"))
    state = torch.load(tmp / "ck.pt", weights_only=True)
    tensors = [*state["model"].values(),
               *(t for s in state["optim"]["state"].values() for t in s.values())]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


# -- stop --------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [[], ["parallel=dp2", "cluster.procs_per_node=2",
                                         "parallel.zero=1"]], ids=["single", "dp2"])
def test_stop_exits_3_with_one_message_and_a_finite_checkpoint(tmp_path, layout):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpctrain", *SMALL, *BLOW_UP, *layout, "train.steps=6",
           "train.checkpoint_every=1", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [ln for ln in out.splitlines() if "non-finite" in ln and "ERROR" in ln]
    assert len(errors) == 1, errors
    assert "step 2: non-finite grad norm" in errors[0]
    assert "Last finite step 1: loss=6.2" in errors[0] and "lower optim.lr" in errors[0]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step_00000001"]  # nothing saved at or after the bad step
    assert _all_finite(run_dir / "checkpoints" / saved[0], tmp_path)
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert (last["step"], last["grad_norm"], last["nonfinite"]) == (2, None, "grad norm")


def _pp_stop_on_rank(zero: int, run_dir: str) -> tuple[str, str, bool]:
    import torch.distributed as dist

    from hpctrain.distributed.dims import ParallelDims
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.train.trainer import Trainer
    from tests.parallel.trainer_runs import BASE

    cfg = make_config([*BASE, "train.steps=4", "cluster.procs_per_node=2", "parallel=pp2",
                       f"parallel.zero={zero}"], run_dir=run_dir)
    mesh = build_mesh(ParallelDims(pp=2), rank=dist.get_rank(), device=torch.device("cpu"))
    with poisoned(1, global_batch=8, dp=1):  # update 2's loss is NaN on the last stage only
        trainer = Trainer(cfg, mesh)
        trainer.guard.after_step(1, trainer.train_one())  # update 1, as run() would
        before = [t.clone() for t in trainer._state_tensors()]
        try:
            trainer.run()  # continues at update 2
        except NonFiniteError as err:
            unchanged = all(torch.equal(a, b) for a, b in
                            zip(before, trainer._state_tensors(), strict=True))
            return "stopped", str(err), unchanged
    return "finished", "", False


@pytest.mark.parametrize("zero", [0, 1], ids=["zero0", "zero1"])
def test_pp2_every_stage_stops_on_a_last_stage_nan_loss(world2, tmp_path, zero):
    results = world2.run(_pp_stop_on_rank, zero, str(tmp_path))
    assert [r[0] for r in results] == ["stopped", "stopped"], results
    assert results[0][1] == results[1][1]  # one message, agreed by both stages
    assert "step 2: non-finite loss (loss=nan" in results[0][1]
    assert "Last finite step 1: loss=6.2" in results[0][1]  # stage 0 learned it from stage 1
    assert results[0][2] and results[1][2]  # no stage applied the bad update


# -- skip --------------------------------------------------------------------------------------
def _skip_on_rank(zero: int, run_dir: str) -> dict:
    import torch.distributed as dist

    from hpctrain.distributed.dims import ParallelDims
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.train.trainer import Trainer

    cfg = make_config([*SMALL, "parallel=dp2", "cluster.procs_per_node=2", f"parallel.zero={zero}",
                       "train.global_batch_size=8", "train.on_nonfinite=skip"], run_dir=run_dir)
    mesh = build_mesh(ParallelDims(dp=2), rank=dist.get_rank(), device=torch.device("cpu"))
    with poisoned(2, global_batch=8, dp=2):  # dp rank 0's batch of update 3
        trainer = Trainer(cfg, mesh)
        trainer.train_one(), trainer.train_one()
        state = [u.shard for u in trainer.dp.units] + trainer.dp.optimizer.tensors()
        before, steps = [t.clone() for t in state], trainer.optimizer.steps
        bad = trainer.train_one()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, state, strict=True))
        steps_after_bad = trainer.optimizer.steps
        good = trainer.train_one()
    return {"bad": (bad["nonfinite"], math.isnan(bad["loss"]), math.isfinite(bad["grad_norm"])),
            "unchanged": unchanged, "optimizer_steps": (steps, steps_after_bad),
            "next": (good["nonfinite"], math.isfinite(good["loss"]), trainer.optimizer.steps)}


@pytest.mark.parametrize("zero", [0, 3])
def test_skip_leaves_weights_and_optimizer_state_unchanged_dp2(world2, tmp_path, zero):
    for r in world2.run(_skip_on_rank, zero, str(tmp_path)):  # rank 1's own loss was finite
        assert r["bad"] == ("loss", True, True), r
        assert r["unchanged"] and r["optimizer_steps"] == (2, 2), r
        assert r["next"] == (None, True, 3), r


def test_skip_run_counts_and_finishes_then_stops_after_the_limit(tmp_path):
    over = [*SMALL, "train.steps=6", "train.on_nonfinite=skip"]
    with poisoned(2, global_batch=4, dp=1):
        dispatch.run(make_config(over, run_dir=tmp_path / "one"))
    records = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["nonfinite"] for r in records] == [None, None, "loss", None, None, None]
    assert records[2]["loss"] is None and records[-1]["nonfinite_skipped"] == 1
    assert records[-1]["loss"] < records[0]["loss"]
    with pytest.raises(NonFiniteError, match="step 11: .*10 consecutive non-finite steps"):
        dispatch.run(make_config([*over, *BLOW_UP, "train.steps=14"], run_dir=tmp_path / "many"))
    assert read_jsonl(tmp_path / "many" / "metrics.jsonl")[-1]["nonfinite_skipped"] == 10


# -- rollback ----------------------------------------------------------------------------------
ROLLBACK = [*SMALL, "train.steps=10", "train.checkpoint_every=3", "train.on_nonfinite=rollback",
            "train.global_batch_size=8"]


def _trajectory(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["nonfinite"], r.get("rolled_back_to"))
            for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_rollback_skips_the_window_and_a_resume_is_bit_identical(tmp_path):
    with poisoned(4, global_batch=8, dp=1):  # update 5
        dispatch.run(make_config(ROLLBACK, run_dir=tmp_path / "straight"))
        dispatch.run(make_config([*ROLLBACK, "train.stop_after=7"], run_dir=tmp_path / "split"))
        dispatch.run(make_config(ROLLBACK, run_dir=tmp_path / "split"))
    straight = _trajectory(tmp_path / "straight")
    assert [r[0] for r in straight] == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10]
    assert straight[4][3:] == ("loss", 3)  # update 5 was bad: back to step 3
    assert all(math.isfinite(r[1]) for r in straight[5:])  # data steps 3, 4 never come back
    assert _trajectory(tmp_path / "split") == straight
    state = json.loads((tmp_path / "straight" / "checkpoints" / "step_00000010" /
                        "train_state.json").read_text())
    assert (state["data_offset"], state["nonfinite_rollbacks"]) == (2, 1)


def _rollback_on_rank(run_dir: str) -> list[tuple]:
    from tests.parallel.trainer_runs import run_trainer

    with poisoned(4, global_batch=8, dp=2):
        trainer = run_trainer(["parallel=dp2", "parallel.zero=2", "train.checkpoint_every=3",
                               "train.on_nonfinite=rollback"], run_dir, steps=10)
    return [(h["loss"], h["nonfinite"]) for h in trainer.history]


def test_rollback_dp2_matches_single_process(world2, tmp_path):
    with poisoned(4, global_batch=8, dp=1):
        dispatch.run(make_config(ROLLBACK, run_dir=tmp_path / "single"))
    ref = [(r[1], r[3]) for r in _trajectory(tmp_path / "single")]
    for got in world2.run(_rollback_on_rank, str(tmp_path / "dp2")):
        assert [g[1] for g in got] == [r[1] for r in ref]
        for (a, _), (b, _) in zip(ref, got, strict=True):
            assert a is None and math.isnan(b) or abs(a - b) <= 1e-5 * a, (ref, got)


def test_rollback_without_a_checkpoint_stops(tmp_path):
    over = [*SMALL, "train.steps=4", "train.on_nonfinite=rollback"]
    with poisoned(1, global_batch=4, dp=1), pytest.raises(
            NonFiniteError, match=r"step 2: non-finite loss .*no checkpoint to roll back to"):
        dispatch.run(make_config(over, run_dir=tmp_path))


# -- checkpoints and config --------------------------------------------------------------------
def _save_poisoned(cfg, mesh) -> dict:
    from hpctrain.train.trainer import Trainer

    trainer = Trainer(cfg, mesh)
    trainer.dp.units[-1].shard.view(-1)[0] = math.inf
    with pytest.raises(NonFiniteError, match=r"refusing to write checkpoint .* rank\(s\) \[0\]"):
        trainer.save()
    return {}


def test_save_refuses_non_finite_weights(tmp_path):
    import torch.distributed as dist

    from hpctrain.launch.worker import run_rank

    cfg = make_config(SMALL, run_dir=tmp_path)
    run_rank(cfg, _save_poisoned, rank=0, world_size=1, local_rank=0,
             store=dist.FileStore(str(tmp_path / "store"), 1))
    assert not (tmp_path / "checkpoints").exists() or not any(
        (tmp_path / "checkpoints").iterdir())


def test_on_nonfinite_must_be_a_known_policy():
    with pytest.raises(ValueError, match="train.on_nonfinite='ignore' is not one of 'stop'"):
        make_config(["train.on_nonfinite=ignore"])


def test_a_non_finite_router_loss_is_named_with_its_coefficient(tmp_path):
    """The z-loss coefficient overflows fp32 (the router's precision): the router loss is inf
    at step 1, and the message names it and its key, not the learning rate."""
    over = ["model=debug_moe", "train=debug", "data.max_bytes=200000", "logger.wandb=disabled",
            "train.eval_every=0", "train.steps=3", "model.moe.z_loss_coef=1e39"]
    with pytest.raises(NonFiniteError) as stopped:
        dispatch.run(make_config(over, run_dir=tmp_path))
    text = str(stopped.value)
    assert text.startswith("step 1: non-finite MoE router loss: router z-loss=inf with "
                           "model.moe.z_loss_coef=1e+39"), text
    assert "lower optim.lr" not in text and "lower the coefficient named" in text

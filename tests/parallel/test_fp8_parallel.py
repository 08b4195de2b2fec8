"""FP8 linears under parallelism and checkpoints: tp=2 (with sp) and pp=2 zb_h1 follow the
FP8 single process to fp32 tolerance (the scales are the single process's: amax reduced over
tp where the tensor or the contraction is split; the deferred W GEMM reuses the B action's
float8 tensors); a checkpoint written with FP8 resumes bit-identically with FP8 on and loads
with FP8 off."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from hpctrain.models import PRESETS, build_model
from hpctrain.parallel.fp8 import apply_fp8
from hpctrain.parallel.tensor import (
    apply_tensor_parallel,
    sync_tp_grads,
    vocab_parallel_cross_entropy,
)
from hpctrain.train import checkpoint as ckpt
from tests.conftest import get_world
from tests.parallel.test_tp_model import _batch, _expected
from tests.parallel.tp_reference import max_err, shard, tp_group
from tests.parallel.trainer_runs import assert_trajectory_close, logged_trajectory, train_in_world

FP8 = ["train.precision=bf16", "train.fp8=true"]
STOP = 2


def _tp_fp8_step(sp: bool, recipe: str) -> dict[str, float]:
    """One fp32 forward/backward of the debug model with every linear (the head too) in FP8,
    single process and tp-sharded: errors relative to the reference's largest value."""
    cfg, group = PRESETS["debug"], tp_group()
    inputs, targets = _batch(cfg)
    ref = build_model(cfg, seed=0)
    apply_fp8(ref, recipe=recipe, skip=())
    logits_ref = ref(inputs)
    F.cross_entropy(logits_ref.flatten(0, 1), targets.flatten()).backward()
    par = build_model(cfg, seed=0)
    plan = apply_tensor_parallel(par, group=group, sp=sp, cfg=cfg)
    assert len(apply_fp8(par, recipe=recipe, skip=())) == 7 * cfg.n_layers + 1
    logits = par(inputs)
    vocab_parallel_cross_entropy(logits, targets, group=group, counter=plan.counter).backward()
    sync_tp_grads(par.parameters(), plan)
    want = shard(logits_ref, -1)
    errs = {"logits": max_err(logits, want) / float(want.abs().max())}
    full = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        g = _expected(name, full[name].grad, cfg)
        errs[name] = max_err(p.grad, g) / float(g.abs().max())
    return errs


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sp", [False, True])
def test_tp2_fp8_equals_single_process(world2, sp, recipe):
    """fp32 compute, every linear in FP8: logits and every gradient slice equal the single
    process's to fp32 tolerance — only if the shards' scales are the full tensors'."""
    for errs in world2.run(_tp_fp8_step, sp, recipe):
        worst = max(errs, key=errs.get)
        assert errs[worst] < 1e-5, (worst, errs[worst])


@pytest.fixture(scope="module", params=["tensorwise", "rowwise"])
def fp8_reference(request, tmp_path_factory):
    recipe = [*FP8, f"train.fp8_recipe={request.param}"]
    run_dir = tmp_path_factory.mktemp(f"fp8_{request.param}")
    return recipe, get_world(1).run(train_in_world, recipe, str(run_dir))[0]


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sp=true"],
                                    ["parallel.pp=2", "parallel.schedule=zb_h1"]])
def test_parallel_fp8_follows_single_process(world2, tmp_path, fp8_reference, layout):
    recipe, ref = fp8_reference
    runs = world2.run(train_in_world, [*recipe, *layout], str(tmp_path / "par"))
    assert_trajectory_close(logged_trajectory(runs), ref)


def test_fp8_checkpoint_resumes_bit_identically_and_loads_without_fp8(tmp_path):
    world = get_world(1)
    saved = tmp_path / "saved"
    world.run(train_in_world, [*FP8, f"train.stop_after={STOP}"], str(saved))
    path = ckpt.latest_complete(saved)
    assert path is not None and path.name.endswith(f"{STOP:08d}")
    straight = world.run(train_in_world, FP8, str(tmp_path / "straight"))[0]
    resumed = world.run(train_in_world, [*FP8, f"train.resume={path}"], str(tmp_path / "on"))[0]
    assert resumed == straight[STOP:]  # bit-identical
    off = world.run(train_in_world, ["train.precision=bf16", f"train.resume={path}"],
                    str(tmp_path / "off"))[0]
    assert len(off) == len(straight) - STOP and off != resumed  # loaded, ran in bf16

"""Trainer runs inside a harness World, shared by the checkpoint-layout and 3D trainer tests."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import build_mesh
from hpctrain.train.trainer import Trainer
from tests.conftest import make_config

STEPS = 4


BASE = ["model=debug", "train=debug", "logger.wandb=disabled", "logger.plot=false",
        "data.max_bytes=200000",
        "train.eval_every=0", "train.global_batch_size=8", "optim.warmup_steps=1"]


def run_trainer(overrides: list[str], run_dir: str, *, steps: int,
                base: tuple[str, ...] = tuple(BASE), run: bool = True) -> Trainer:
    """The real Trainer on this rank of the world (cluster = the world), after `run()`
    (`run=False`: as built); `base`: the overrides before `overrides` (BASE: model=debug)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    cfg = make_config([*base, f"train.steps={steps}",
                       f"cluster.procs_per_node={dist.get_world_size()}", *overrides],
                      run_dir=run_dir)
    mesh = build_mesh(cfg.parallel.dims, rank=dist.get_rank(), device=torch.device("cpu"))
    trainer = Trainer(cfg, mesh)
    if run:
        trainer.run()
    return trainer


def losses_and_memory(overrides: list[str], run_dir: str, *, steps: int):
    """The trainer on this world with `overrides` alone (no BASE): its losses and memory."""
    trainer = run_trainer(overrides, run_dir, steps=steps, base=())
    return [m["loss"] for m in trainer.history], trainer.memory_metrics()


def train_in_world(overrides: list[str], run_dir: str) -> list[tuple[float, float]]:
    trainer = run_trainer(overrides, run_dir, steps=STEPS)
    return [(h["loss"], h["grad_norm"]) for h in trainer.history]


def logged_trajectory(runs):
    """The trajectory as seen by the logging rank (loss is NaN off the last pipeline stage)."""
    return next(r for r in runs if r and r[0][0] == r[0][0])


def assert_trajectory_close(got, want) -> None:
    """(loss, grad norm) per step equal to fp32 tolerance (losses 1e-5, norms 1e-4 relative)."""
    import pytest

    assert len(got) == len(want)
    for (loss, norm), (loss1, norm1) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss1, rel=1e-5)
        assert norm == pytest.approx(norm1, rel=1e-4)


def zero3_memory(overrides: list[str], run_dir: str, *, steps: int = 2):
    """The trainer on this world (BASE + `overrides`) for `steps`: its (loss, grad norm)
    trajectory, its memory metrics, and under ZeRO-3 the bytes of the unit outside the blocks
    and of the two largest consecutive blocks (with their experts' units), from the engine's
    own units, and the planner's gathered bytes for the run (`plan.memory.model`)."""
    from hpctrain.plan.inputs import layout_of, step_shape
    from hpctrain.plan.memory.model import gathered_bytes

    trainer = run_trainer(overrides, run_dir, steps=steps)
    trajectory = [(h["loss"], h["grad_norm"]) for h in trainer.history]
    z = trainer.dp.zero3
    if z is None:
        return trajectory, trainer.memory_metrics(), None
    size = [u.layout.padded_numel * u.full.element_size() for u in z.units]
    blocks = [sum(size[u] for u in z.members[k]) for k in range(1, len(z.blocks) + 1)]
    two = max(a + b for a, b in zip(blocks, blocks[1:], strict=False))
    planned = gathered_bytes(trainer.cfg.model, layout_of(trainer.cfg), step_shape(trainer.cfg))
    return trajectory, trainer.memory_metrics(), (size[0], two, sum(blocks), planned)


def initial_values(overrides: list[str], run_dir: str) -> tuple[list[str], int]:
    """The trainer's set-up on this rank of the world (BASE + `overrides`; the model built on
    meta, only the rank's own elements computed): the parameters whose master values (gathered
    over each unit's group), or at ZeRO 0-2 whose compute values, differ in any bit from the
    single-process model's (its ep and tp slice), and how many were compared."""
    from hpctrain.models import build_model
    from hpctrain.parallel.data.state import full_model_state

    trainer = run_trainer(overrides, run_dir, steps=1, run=False)
    cfg, engine = trainer.cfg, trainer.dp
    # every name of the single-process model, a tied head's too (it is the embedding)
    ref = dict(build_model(cfg.model, seed=cfg.train.seed).named_parameters(
        remove_duplicate=False))
    masters, differ = full_model_state(engine), []
    for name, value in masters.items():
        want = trainer.parallel.shards[name].local_of(ref[name].detach())
        if not torch.equal(value, want.to(value.dtype)):
            differ.append(f"master {name}")
    if engine.zero < 3:
        for name, p in trainer.model.named_parameters():
            want = trainer.parallel.shards[name].local_of(ref[name])
            if not torch.equal(p.detach(), want.detach().to(p.dtype)):
                differ.append(f"param {name}")
    return differ, len(masters)

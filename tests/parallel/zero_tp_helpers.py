"""Rank-side functions for the ZeRO × tp × pp tests (module-level: they are pickled).

tp=2 × dp=2: every rank builds the single-process fp64 reference from the same seed and trains
it with torch AdamW on the whole global batch; the parallel run shards the same model over tp,
wraps it in the data-parallel engine (ZeRO over dp, tp hooks passed in) and feeds each dp rank
its slice of the global batch. Parameters are compared slice by slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh
from hpctrain.models import build_model
from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.data.state import full_model_state
from hpctrain.parallel.scaler import LossScaler
from hpctrain.parallel.state import norm_spec, placements
from hpctrain.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from hpctrain.train.tensor_parallel import tp_pre_reduce
from tests.parallel.dp_helpers import OPTIM
from tests.parallel.threed_reference import expected_slice, model_cfg
from tests.parallel.trainer_runs import run_trainer
from tests.references import ce64, micro_batches, reference_run

SEED, MICRO, SEQ, ACCUM = 7, 2, 8, 2
CLIP = 0.05  # below the gradient norm: the clip (and its replica-aware norm) is exercised


def _micro_batches(step: int, *, n: int, vocab: int):
    return micro_batches(n, MICRO, SEQ, vocab=vocab, seed=100 + step)


def _fp64_loss(logits_BLV, targets_BL):
    """lm_loss without its cast to fp32 (the vocab-parallel loss keeps fp64)."""
    return F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL.flatten())


def _reference(cfg, steps: int, *, n: int):
    return reference_run(build_model(cfg, seed=SEED).double(), OPTIM, steps,
                         lambda step: _micro_batches(step, n=n, vocab=cfg.vocab_size),
                         grad_clip=CLIP, loss_fn=ce64)


def tp_dp_zero_errors(zero: int, steps: int, *, sp: bool = False
                      ) -> tuple[float, list[float], list[float]]:
    """tp=2 × dp=2 with ZeRO `zero`: (max |param − reference slice|, norms, reference norms).
    Without sp the reduction overlaps backward; with sp it follows the tp gradient sync."""
    dims, rank = ParallelDims(dp=2, tp=2), dist.get_rank()
    mesh = build_mesh(dims, rank=rank, device=torch.device("cpu"))
    cfg = model_cfg(4)
    ref, ref_norms = _reference(cfg, steps, n=dims.dp * ACCUM)
    model = build_model(cfg, seed=SEED).double()
    plan = apply_tensor_parallel(model, group=mesh.group("tp"), sp=sp, cfg=cfg, seed=SEED)
    engine = DataParallel(model, group=mesh.group("dp"), batch_group=mesh.group("dp"),
                          zero=zero, precision="fp32",
                          optim=OPTIM, bucket_mb=0.001,
                          norm=norm_spec(placements(model, tp_plan=plan, stages=None,
                                                    tied=None), mesh),
                          pre_reduce=tp_pre_reduce(model, plan))

    def loss_fn(logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, group=plan.group,
                                            counter=plan.counter)

    dp_rank, norms = mesh.coord("dp"), []
    for step in range(steps):
        mbs = _micro_batches(step, n=dims.dp * ACCUM, vocab=cfg.vocab_size)
        mine = [mbs[m * dims.dp + dp_rank] for m in range(ACCUM)]  # micro m, replica dp_rank
        r = engine.train_step(mine, n_micro=ACCUM, precision="fp32",
                              scaler=LossScaler(enabled=False), grad_clip=CLIP, loss_fn=loss_fn)
        norms.append(r.grad_norm)
    got = full_model_state(engine)
    err = max(float((got[n] - expected_slice(n, ref[n], cfg, tp=2, tp_rank=mesh.coord("tp")))
                    .abs().max()) for n in got)
    return err, norms, ref_norms


STEPS = 3


def train_params(overrides: list[str], run_dir: str):
    """Trainer run (fp32, model=debug): (loss/norm trajectory, this rank's full-over-dp,
    full-over-tp parameters by name or None under tp > 1)."""
    trainer = run_trainer(overrides, run_dir, steps=STEPS)
    cfg = trainer.cfg
    params = None
    if cfg.parallel.tp == 1:
        params = full_model_state(trainer.dp)
    return [(h["loss"], h["grad_norm"]) for h in trainer.history], params

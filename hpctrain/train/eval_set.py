"""The evaluation set: train.eval_samples fixed validation samples, split over the dp ranks.

Samples 0 .. S−1 of the validation split (S = train.eval_samples, wrapping around a split
shorter than S) are the same for every layout; dp rank r evaluates the contiguous share
[r·S/dp, (r+1)·S/dp) in micro-batches of train.micro_batch_size. Every layout thus averages the
loss over the same tokens (hpctrain.parallel.step.eval_loss weights by real tokens), so
eval_loss at a step is the same, up to fp32 rounding, for single, dp, tp, pp and cp runs.
"""

from __future__ import annotations

from hpctrain.config.rule import check
from hpctrain.config.schema import Config


def eval_split_problem(samples: int, *, dp: int, micro_batch: int) -> str | None:
    """Why `samples` cannot be split into whole micro-batches over `dp` ranks, with the fix
    (None when it can)."""
    per = dp * micro_batch
    if samples % per == 0:
        return None
    near = sorted({max(per, samples // per * per), (samples // per + 1) * per})
    return (f"train.eval_samples={samples} is not divisible by parallel.dp={dp} × "
            f"train.micro_batch_size={micro_batch} = {per} (each dp rank evaluates an equal "
            f"share in whole micro-batches): use a multiple of {per}, e.g. "
            f"{' or '.join(f'train.eval_samples={n}' for n in near)}")


def eval_indices(n_val: int, *, samples: int, dp: int, dp_rank: int,
                 micro_batch: int) -> list[list[int]]:
    """Rank `dp_rank`'s micro-batches of validation sample indices (module doc); `samples`
    must split evenly (`eval_split_problem` is None)."""
    if eval_split_problem(samples, dp=dp, micro_batch=micro_batch) is not None:
        raise ValueError(eval_split_problem(samples, dp=dp, micro_batch=micro_batch))
    share = samples // dp
    first = dp_rank * share
    return [[(first + j + i) % n_val for i in range(micro_batch)]
            for j in range(0, share, micro_batch)]


@check("train.eval_samples", "train.eval_every", "train.global_batch_size",
       "train.micro_batch_size", "parallel.")
def check_eval(c: Config) -> list[str]:
    t = c.train
    if not t.eval_every:
        return []
    problem = eval_split_problem(t.eval_samples, dp=c.parallel.dp, micro_batch=t.micro_batch_size)
    return [problem] if problem else []

"""Predict a published run whose report leaves settings out, and say what was assumed.

A paper or a README gives the model, the degrees (tp, pp, dp) and the global batch, and often
not the micro-batch size, the recomputation, the interleaving or the schedule. The run could
have used any of the options its software allows; whoever ran it tuned them for speed. So
`assume_unstated` times every combination within `Allowed` (`hpctrain.plan.time.step_time`,
memory from `hpctrain.plan.memory.formulas` under the layout's ZeRO stage), keeps those that fit in
the device's memory, and returns the fastest with the settings it took (`Assumed.describe`).
A stack that reduces gradients in fp32 (`Stack.grad_reduce`) keeps them in an fp32 buffer
(Megatron's main_grad): 2 more bytes per unsharded parameter than the memory model's bf16
gradients, added before the fit check. Nothing is fitted: the options are the run's, the
constants the device generation's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.layout import Layout, layout_problems
from hpctrain.plan.search import Candidate, evaluate_layout
from hpctrain.plan.shapes import Shape, rank_params
from hpctrain.plan.stack import NONE, Stack


@dataclass(frozen=True)
class Allowed:
    """The options a run's report leaves open (every value its software supports)."""

    micro_batch_sizes: Sequence[int] = (1,)
    recomputes: Sequence[str] = ("none",)
    virtual_stages: Sequence[int] = (1,)  # > 1: the interleaved 1F1B schedule


@dataclass(frozen=True)
class Assumed:
    """The fastest fitting combination: its Candidate and micro-batch size."""

    candidate: Candidate
    micro_batch_size: int
    stack: Stack

    def describe(self) -> str:
        c = self.candidate
        return (f"mbs {self.micro_batch_size}, recompute {c.recompute}, "
                f"{c.layout.schedule} v{c.layout.virtual_stages}, {self.stack.describe()}")


def assume_unstated(model: Shape, cluster: ClusterSpec, *, layout: Layout, global_batch: int,
                    seq_len: int, allowed: Allowed, precision: str = "bf16",
                    ov: Stack = NONE) -> Assumed:
    """The fastest fitting settings within `allowed` for `layout`'s degrees (module doc);
    ValueError when no combination is valid for the model and batch."""
    found = []
    for mbs in allowed.micro_batch_sizes:
        for v in allowed.virtual_stages:
            lay = _with_v(layout, v)
            if lay is None or layout_problems(model, lay, global_batch=global_batch,
                                              micro_batch_size=mbs):
                continue
            for recompute in allowed.recomputes:
                c = evaluate_layout(model, cluster, lay, recompute, global_batch=global_batch,
                                    micro_batch_size=mbs, seq_len=seq_len, precision=precision,
                                    dp_overlap=0.0, ov=ov, issued=False)
                fits = c.memory.total + _fp32_grads(model, lay, precision, ov) \
                    <= cluster.device.memory_bytes
                found.append(Assumed(replace(c, fits=fits), mbs, ov))
    if not found:
        raise ValueError(f"no micro-batch size in {list(allowed.micro_batch_sizes)} and v in "
                         f"{list(allowed.virtual_stages)} is valid for {layout.describe()} "
                         f"and global_batch={global_batch}: widen Allowed")
    fitting = [a for a in found if a.candidate.fits] or found
    return min(fitting, key=lambda a: a.candidate.time.step_time_s)


def _fp32_grads(model: Shape, layout: Layout, precision: str, ov: Stack) -> float:
    """Bytes an fp32 gradient buffer adds over the memory model's gradients (module doc)."""
    if ov.grad_reduce != "fp32" or precision == "fp32":
        return 0.0
    shards = layout.dims.shard_size if layout.zero >= 2 else 1
    return 2 * rank_params(model, tp=layout.tp, pp=layout.pp) / shards


def _with_v(layout: Layout, v: int) -> Layout | None:
    if v == 1:
        return layout
    if layout.pp == 1:
        return None
    return replace(layout, virtual_stages=v, schedule="interleaved_1f1b")

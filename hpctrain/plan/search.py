"""Layout search: every valid (dp, cp, tp, pp, v, ZeRO, ep, schedule, recompute) for n
devices, scored (ep only for models with routed experts: `experts.expert_degrees`).

Candidates that fit in device memory are ranked by predicted step time (ties: lower ZeRO
stage, less recomputation, less memory); the rest follow, smallest first. Each candidate
carries a one-line reason saying why it is not the winner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from hpctrain.distributed.dims import divisors
from hpctrain.models.config import ModelConfig
from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.experts import expert_degrees
from hpctrain.plan.layout import RECOMPUTES, Layout, layout_problems
from hpctrain.plan.memory.formulas import MemoryBreakdown
from hpctrain.plan.memory.model import StepShape, rank_memory
from hpctrain.plan.shapes import Shape
from hpctrain.plan.stack import NONE, Stack
from hpctrain.plan.time import StepTime, step_time

GIB = 2**30
BUBBLE_NOTE = 0.10  # bubbles above this fraction are called out in the reason
DP_NOTE = 0.20  # exposed dp communication above this share of the step is called out
EP_NOTE = 0.20  # MoE all-to-all above this share of the step is called out


@dataclass(frozen=True)
class Candidate:
    """One scored layout. `reason` is 'best' for the winner, else why it lost."""

    layout: Layout
    recompute: str
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    reason: str = ""
    exact: bool = True  # False: `time` is the bound before the pipeline bubble (pruned)


def _pipelines(pp: int, schedules: Sequence[str], virtual_stages: Sequence[int]):
    """(schedule, v) pairs for pp ranks; pp = 1 has no pipeline, so only ('1f1b', 1)."""
    if pp == 1:
        yield "1f1b", 1
        return
    for schedule in schedules:
        if schedule == "interleaved_1f1b":
            yield from ((schedule, v) for v in virtual_stages if v > 1)
        elif schedule == "zbv":
            yield schedule, 2
        else:
            yield schedule, 1


def enumerate_layouts(
    model: Shape, *, n_devices: int, global_batch: int, micro_batch_size: int,
    schedules: Sequence[str], zero_stages: Sequence[int], virtual_stages: Sequence[int],
    context_parallel: Sequence[int] = (1,), gpus_per_node: int = 0,
) -> Iterator[Layout]:
    """Valid layouts with dp·cp·tp·pp = n_devices (`layout_problems` empty), cp from
    `context_parallel` (the caller keeps those dividing the sequence into 2·cp chunks); sp on
    when tp > 1; ZeRO stages > 0 only when dp·cp > 1 (they shard nothing otherwise); no
    ZeRO-3 with pipelines (hpctrain gathers ZeRO-3 parameters per block of a whole model, so
    it refuses that mix); ep from the divisors of dp that divide the model's experts; with
    ZeRO ≥ 1 across nodes, also HSDP with one shard group per node (`_replicas`)."""
    for cp in (c for c in context_parallel if n_devices % c == 0):
        for tp in divisors(n_devices // cp):
            for pp in divisors(n_devices // (cp * tp)):
                dp = n_devices // (cp * tp * pp)
                for schedule, v in _pipelines(pp, schedules, virtual_stages):
                    for zero in zero_stages if dp * cp > 1 else (0,):
                        if zero == 3 and pp > 1:
                            continue
                        for ep in expert_degrees(model, dp):
                            for r in _replicas(dp, cp * tp, ep, zero, gpus_per_node):
                                layout = Layout(dp=dp, tp=tp, pp=pp, virtual_stages=v,
                                                zero=zero, sp=tp > 1, schedule=schedule,
                                                cp=cp, ep=ep, dp_replicate=r)
                                if not layout_problems(model, layout, global_batch=global_batch,
                                                       micro_batch_size=micro_batch_size):
                                    yield layout


def _replicas(dp: int, inner: int, ep: int, zero: int, gpus_per_node: int) -> tuple[int, ...]:
    """dp_replicate degrees to try: 1, and with ZeRO ≥ 1 the one that makes a shard group
    (dp_shard·cp·tp consecutive ranks, `inner` = cp·tp) exactly one node, when the dp group
    spans several nodes and ep divides dp_shard."""
    if zero == 0 or gpus_per_node < 1 or gpus_per_node % inner:
        return (1,)
    shard = gpus_per_node // inner
    if dp <= shard or dp % shard or shard % ep:
        return (1,)
    return (1, dp // shard)


def evaluate_layout(model, cluster, layout, recompute, *, global_batch, micro_batch_size,
                    seq_len, precision, dp_overlap, in_flight: int | None = None,
                    attended_per_token: float | None = None, fp8: bool = False,
                    exact: bool = True, ov: Stack = NONE, bucket_mb: float = 25.0,
                    zero3_reshard: bool = True, issued: bool = True) -> Candidate:
    """Memory (the one model, `plan.rank_memory`) and time of one layout. in_flight:
    activation sets alive at the peak on every pipeline rank; None takes the schedule's, rank
    by rank. attended_per_token: keys per token under document masks (`plan.time.step_time`).
    fp8: FP8 linears (train.fp8): their GEMMs at the FP8 peak, their float8 weight copies.
    exact=False: the step time without the pipeline's bubble (a lower bound, not simulated).
    ov: the communication the stack overlaps (`hpctrain.plan.stack`). zero3_reshard:
    train.zero3_reshard_after_forward (a ZeRO-3 layout's gathered blocks). issued: time the
    collectives hpctrain issues for a `ModelConfig` (`plan.time.step_time`); False, or a
    published table's shape, the traffic of the published stack `ov` describes."""
    m = global_batch // (micro_batch_size * layout.dp)
    step = StepShape(seq_len=seq_len, micro_batch_size=micro_batch_size, microbatches=m,
                     recompute=recompute, precision=precision, fp8=fp8, bucket_mb=bucket_mb,
                     zero3_reshard=zero3_reshard)
    mem = rank_memory(model, layout, step,
                      in_flight=None if in_flight is None else (in_flight,) * layout.pp)
    t = step_time(model, cluster, layout=layout, global_batch=global_batch,
                  micro_batch_size=micro_batch_size, seq_len=seq_len, recompute=recompute,
                  precision=precision, dp_overlap=dp_overlap,
                  attended_per_token=attended_per_token, fp8=fp8, pipeline=exact, ov=ov,
                  issued=step if issued and isinstance(model, ModelConfig) else None)
    return Candidate(layout, recompute, mem, t, mem.fits(cluster.device.memory_bytes),
                     exact=exact or layout.pp == 1)


def _reason(c: Candidate, best: Candidate | None, cluster: ClusterSpec) -> str:
    if not c.fits:
        return (f"does not fit: {c.memory.total / GIB:.1f} GiB > "
                f"{cluster.device.memory_bytes / GIB:.1f} GiB")
    if c is best:
        return "best"
    ratio = c.time.step_time_s / best.time.step_time_s
    if not c.exact:
        return f"slower: ≥ {ratio:.2f}× best before its pipeline bubble (not simulated)"
    notes = [f"slower: {ratio:.2f}× best"]
    if c.time.bubble_fraction > BUBBLE_NOTE:
        notes.append(f"bubble {c.time.bubble_fraction:.0%}")
    if c.layout.tp > cluster.gpus_per_node:
        notes.append("tp all-reduce crosses nodes")
    if c.time.comm_dp_s > DP_NOTE * c.time.step_time_s:
        notes.append(f"dp comm {c.time.comm_dp_s / c.time.step_time_s:.0%} of step")
    if c.time.comm_ep_s > EP_NOTE * c.time.step_time_s:
        notes.append(f"all-to-all {c.time.comm_ep_s / c.time.step_time_s:.0%} of step")
    return "; ".join(notes)


def search_layouts(
    model: Shape, cluster: ClusterSpec, *, n_devices: int, global_batch: int,
    micro_batch_size: int, seq_len: int, precision: str = "bf16",
    schedules: Sequence[str] = ("1f1b", "interleaved_1f1b", "zb_h1"),
    zero_stages: Sequence[int] = (0, 1, 2, 3), recomputes: Sequence[str] = RECOMPUTES,
    virtual_stages: Sequence[int] = (2, 4), dp_overlap: float = 0.0,
    attended_per_token: float | None = None, context_parallel: Sequence[int] = (1,),
    fp8: bool = False, exact_top: int | None = None,
    accept: Callable[[Candidate], bool] | None = None,
    where: Callable[[Layout, str], bool] | None = None, zero3_reshard: bool = True,
) -> list[Candidate]:
    """All valid candidates, fitting ones fastest first, each with its reason (module doc).
    `context_parallel`: cp degrees to try; those not dividing seq_len into 2·cp chunks are
    dropped. With `exact_top`, branch and bound: every candidate is first timed without its
    pipeline bubble (a lower bound: bubbles and exposed p2p only add), then the fitting ones
    are simulated in order of that bound until `exact_top` of them (those `accept` takes, if
    given) are known and the next bound is no faster than the slowest of those; the rest keep
    their bound (`exact=False`) and are listed after the simulated ones. The winners are the
    same as simulating everything; the pipeline simulator runs for a few candidates instead
    of thousands (llama3_70b on 64 H100s: 15 s instead of more than 25 minutes). `where`
    (layout, recompute) → bool limits the search to the pairs it takes."""
    if n_devices < 1:
        raise ValueError(f"n_devices={n_devices} must be >= 1")
    layouts = enumerate_layouts(
        model, n_devices=n_devices, global_batch=global_batch,
        micro_batch_size=micro_batch_size, schedules=schedules, zero_stages=zero_stages,
        virtual_stages=virtual_stages,
        context_parallel=[c for c in context_parallel if c == 1 or seq_len % (2 * c) == 0],
        gpus_per_node=cluster.gpus_per_node,
    )
    kw = dict(global_batch=global_batch, micro_batch_size=micro_batch_size, seq_len=seq_len,
              precision=precision, dp_overlap=dp_overlap, attended_per_token=attended_per_token,
              fp8=fp8, zero3_reshard=zero3_reshard)
    exact = exact_top is None
    scored = [evaluate_layout(model, cluster, lay, r, **kw, exact=exact)
              for lay in layouts for r in recomputes if where is None or where(lay, r)]
    order = {r: i for i, r in enumerate(RECOMPUTES)}

    def rank(c: Candidate):
        return c.time.step_time_s, c.layout.zero, order[c.recompute], c.memory.total

    fitting = sorted((c for c in scored if c.fits), key=rank)
    if not exact:
        fitting = _bound(fitting, exact_top, accept, rank,
                         lambda c: evaluate_layout(model, cluster, c.layout, c.recompute, **kw))
    rest = sorted((c for c in scored if not c.fits), key=lambda c: c.memory.total)
    best = fitting[0] if fitting else None
    return [_with_reason(c, best, cluster) for c in fitting + rest]


def _bound(by_bound: list[Candidate], top: int, accept, rank, simulate) -> list[Candidate]:
    """Branch and bound over candidates sorted by their lower bound (`search_layouts`)."""
    done: list[Candidate] = []
    kept: list[float] = []  # step times of the accepted exact candidates, ascending
    for i, c in enumerate(by_bound):
        if len(kept) >= top and c.time.step_time_s >= kept[top - 1]:
            return sorted(done, key=rank) + by_bound[i:]
        full = c if c.exact else simulate(c)
        done.append(full)
        if accept is None or accept(full):
            kept = sorted([*kept, full.time.step_time_s])
    return sorted(done, key=rank)


def _with_reason(c: Candidate, best: Candidate | None, cluster: ClusterSpec) -> Candidate:
    return replace(c, reason=_reason(c, best, cluster))

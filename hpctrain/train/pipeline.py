"""The trainer's pipeline-parallel step (parallel.pp > 1): run the schedule over this rank's
finished stages (built by hpctrain.train.setup), measure the bubble; the update is the
data-parallel engine's, as for every layout (hpctrain.parallel.data: reduction over dp, the
global norm over dp shards, tp and pp as the shard spec says, clip, AdamW, ZeRO 0-2). With
parallel.tp > 1 the stages are tensor-parallel (hpctrain.parallel.pipeline.tp_stages). The
schedule runs under the engine reducer's no_sync, so
no dp collective interleaves with the pipeline's p2p: the reduction runs after the schedule.

Loss scaling is the same as the plain step: each microbatch's mean loss / d_i on the last stage,
weighted by its real tokens (hpctrain.parallel.step `loss_divisors`; d_i = m without padding),
gradients averaged over dp. Clipping uses the global norm: squared norms of each rank's stage
parameters are summed over the pp group. The loss (and eval loss, computed by the runtime's
forward-only path) is known on the rank holding the last stage — the last pp rank, or pp rank 0
under a V schedule — and shared from there over the pp group, so the logging rank reports it for
every schedule. Whether the loss is finite reaches every stage before the update: it rides in
the norm's all-reduce (hpctrain.parallel.finite), so a non-finite loss or norm skips the update
on every rank.

Measured bubble: before each step the pp group meets at a barrier; each rank records its compute
actions (perf_counter relative to that start). A rank's bubble is 1 − busy/span, span = the time
from the start to the end of its action list (sends drained). `bubble_measured` is the max over
the pp ranks (the worst rank, like the simulator's bubble rate that takes the slowest rank), and
`bubble_measured_mean` the mean.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.config.schema import Config
from hpctrain.distributed.mesh import Mesh, group_size
from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.pipeline.actions import Action, ActionKind, Schedule
from hpctrain.parallel.pipeline.hop import stage_hop
from hpctrain.parallel.pipeline.lowering import lower_comm
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.stage import LocalStages
from hpctrain.parallel.pipeline.tied import TiedEmbeddings, build_tied
from hpctrain.parallel.pipeline.timeline import draw_timeline
from hpctrain.parallel.pipeline.tp_stages import stage_act_shape
from hpctrain.parallel.scaler import LossScaler
from hpctrain.parallel.step import StepResult, allreduce_mean, loss_divisors
from hpctrain.parallel.tensor import TensorParallelPlan
from hpctrain.train.tensor_parallel import step_loss

Timeline = list[tuple[float, float, Any]]


class PipelineEngine:
    """The runtime for this rank's lowered action list over its finished stages (built by
    `hpctrain.train.setup.build_rank_model` in the one order of every layout), the tied
    embeddings across stages, and the pipeline's step, evaluation and timeline."""

    def __init__(self, cfg: Config, mesh: Mesh, local: LocalStages, schedule: Schedule, *,
                 tp_plan: TensorParallelPlan | None):
        p, t = cfg.parallel, cfg.train
        self.cfg, self.mesh, self.schedule, self.local = cfg, mesh, schedule, local
        self.pp_rank = mesh.coord("pp")
        self.peers = mesh.dims.group_ranks("pp", mesh.rank)
        s2r = self.schedule.stage_to_rank
        self.tied: TiedEmbeddings | None = None
        if cfg.model.tied_embeddings:
            self.tied = build_tied(self.local, dims=mesh.dims, rank=mesh.rank,
                                   n_stages=self.schedule.n_stages,
                                   pp_ranks_apart=s2r[0] != s2r[-1],
                                   timeout_s=cfg.cluster.timeout_s)
        self.act_shape = stage_act_shape(micro_batch=t.micro_batch_size,
                                         seq_len=t.seq_len // p.cp,
                                         dim=cfg.model.dim, tp=p.tp, sp=p.sp)
        self.runtime = PipelineRuntime(lower_comm(self.schedule), self.local,
                                       pp_rank=self.pp_rank, peers=self.peers,
                                       act_shape=self.act_shape, precision=t.precision,
                                       loss_fn=step_loss(tp_plan),
                                       batched=dist.get_backend() == "nccl",
                                       timeout=mesh.timeout, hop=stage_hop(mesh, sp=p.sp))
        self.last_timeline: Timeline = []

    @property
    def holds_loss(self) -> bool:
        return self.schedule.n_stages - 1 in self.local.parts

    def loss_order(self) -> list[int]:
        """The microbatches in the order this rank computes their loss (the last stage's F
        actions; [] on a rank without the last stage)."""
        last = self.schedule.n_stages - 1
        return [a.microbatch for a in self.schedule.actions[self.pp_rank]
                if a.kind == ActionKind.F and a.stage == last]

    @property
    def loss_fn(self) -> Callable:
        """The last stage's loss (logits, targets → mean loss); settable, so the trainer can
        wrap it (hpctrain.train.source_loss)."""
        return self.runtime.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: Callable) -> None:
        self.runtime.loss_fn = fn

    def train_step(self, engine: DataParallel, micro_batches, *, scaler: LossScaler,
                   grad_clip: float) -> tuple[StepResult, dict[str, float]]:
        """One batch through the schedule, then the update of the data-parallel `engine`
        (the one update path of every layout: reduction, global norm, clip, AdamW)."""
        pp_group = self.mesh.group("pp")
        multiplier = scaler.loss_multiplier()
        self.runtime.loss_multiplier = multiplier
        dist.barrier(group=pp_group)  # aligned starts make the measured timelines comparable
        start = time.perf_counter()
        # The engine's bucket hooks must not issue dp collectives between the schedule's p2p
        # messages: gradients only accumulate during the schedule, reduction comes after.
        micro_batches = list(micro_batches)
        divisors = loss_divisors(micro_batches, dp_group=self.mesh.dp_cp,
                                 device=self.mesh.device)
        with engine.reducer.no_sync():
            result = self.runtime.step(micro_batches, start=start, divisors=divisors)
        span = time.perf_counter() - start
        self.last_timeline = result.timeline
        loss = (result.loss_sum.to(torch.float64).reshape(()) if result.loss_sum is not None
                else None)
        step = engine.reduce_and_update(scaler=scaler, multiplier=multiplier,
                                        grad_clip=grad_clip, loss=loss)
        # The update averaged the loss over dp on the last stage's rank; share it over pp.
        held = torch.tensor(step.loss) if self.holds_loss else None
        step.loss = float(last_stage_value(held, holds=self.holds_loss, group=pp_group,
                                           device=self.mesh.device))
        metrics = measured_bubble(result.timeline, span, group=pp_group, device=self.mesh.device)
        return step, metrics

    def pre_reduce(self, then: Callable[[], None] | None) -> Callable[[], None] | None:
        """With embeddings tied across pp ranks, their gradient sum before the dp reduction,
        followed by `then` (tp's sync); else `then` itself."""
        tied = self.tied
        if tied is None or not tied.split:
            return then

        def pre_reduce() -> None:
            tied.sum_grads()
            if then is not None:
                then()

        return pre_reduce

    def eval_loss(self, batches) -> float:
        """Mean loss over every real token of `batches` on all dp ranks, forward only through
        the schedule's own F path (`PipelineRuntime.evaluate`), in chunks of at most m
        microbatches, weighted as the train step (`loss_divisors`); the value is shared from
        the last stage's rank to its pp group (`last_stage_value`), then averaged over dp."""
        batches, m = list(batches), self.schedule.n_microbatches
        d = loss_divisors(batches, dp_group=self.mesh.dp_cp, device=self.mesh.device)
        parts = [self.runtime.evaluate(batches[i:i + m], divisors=d[i:i + m])
                 for i in range(0, len(batches), m)]
        return self._reported(torch.stack(parts).sum() if self.holds_loss else None)

    def _reported(self, value: torch.Tensor | None) -> float:
        """A last-stage value (None on other ranks) → the same float on every rank of the
        replica's pp group, averaged over dp."""
        value = last_stage_value(value, holds=self.holds_loss, group=self.mesh.group("pp"),
                                 device=self.mesh.device)
        allreduce_mean([value], self.mesh.dp_cp)
        return float(value)

    def write_timeline(self, run_dir: Path, *, step: int) -> dict[str, str] | None:
        """Gather every pp rank's last measured timeline; the logging rank writes
        `pipeline_timeline.json` (Chrome trace) and `pipeline_timeline.png`. Collective."""
        gathered: list[Timeline | None] = [None] * self.mesh.dims.pp
        boxes = [(t0, t1, str(a)) for t0, t1, a in self.last_timeline]
        dist.all_gather_object(gathered, boxes, group=self.mesh.group("pp"))
        if not self.mesh.is_logging_rank:
            return None
        return write_timeline_files(gathered, run_dir, title=f"{self.schedule.name} measured, "
                                    f"pp={self.schedule.n_ranks}, m={self.schedule.n_microbatches}"
                                    f", step {step}")


def last_stage_value(value: torch.Tensor | None, *, holds: bool, group,
                     device: torch.device) -> torch.Tensor:
    """The fp64 scalar `value` of the one rank of `group` that holds the last stage (the last
    pp rank, or pp rank 0 under a V schedule), on every rank of `group`: a sum in which the
    other ranks contribute 0. A holder without a value (it ran no microbatch) gives NaN."""
    if holds:
        out = (value if value is not None else torch.tensor(math.nan)).to(device, torch.float64)
    else:
        out = torch.zeros((), dtype=torch.float64, device=device)
    out = out.reshape(()).clone()
    if group_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


def measured_bubble(timeline: Timeline, span: float, *, group,
                    device: torch.device | None = None) -> dict[str, float]:
    """1 − busy/span on this rank; max and mean over `group` (see the module docstring)."""
    busy = sum(t1 - t0 for t0, t1, _ in timeline)
    bubble = 1.0 - busy / span if span > 0 else 0.0
    stats = torch.tensor([bubble, bubble], dtype=torch.float64, device=device)  # NCCL: GPU
    n = group_size(group)
    if n > 1:
        top = stats[:1].clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(stats[1:], group=group)
        stats[0] = top[0]
    return {"bubble_measured": float(stats[0]), "bubble_measured_mean": float(stats[1]) / n}


def write_timeline_files(timelines, run_dir: Path, *, title: str) -> dict[str, str]:
    """Per rank [(start_s, end_s, 'stageKINDmb')] → Chrome trace JSON + PNG in `run_dir`."""
    run_dir = Path(run_dir)
    events, boxes = [], []
    for rank, acts in enumerate(timelines):
        row = []
        for t0, t1, text in acts:
            a = Action.parse(text)
            events.append({"name": text, "cat": a.kind.value, "ph": "X", "pid": 0, "tid": rank,
                           "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6,
                           "args": {"stage": a.stage, "microbatch": a.microbatch}})
            row.append((t0, t1, str(a.microbatch), a.kind.value))
        boxes.append(row)
    trace = run_dir / "pipeline_timeline.json"
    trace.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    png = draw_timeline(boxes, run_dir / "pipeline_timeline.png", title=title)
    return {"timeline_trace": str(trace), "timeline_png": str(png)}

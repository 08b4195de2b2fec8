"""Calibrated sleep-based pipeline stages for bench_pp part 2, and the one-way p2p latency.

A `SleepStage` computes y = x·w with an autograd function that sleeps t_f in forward, t_b in
backward and t_w in the weight gradient (deferred through the stage's WeightGradQueue on B
actions, exactly as hpctrain's Linear does), so a schedule's measured bubble is the schedule's
and the runtime's, not CPU contention's.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from common import median
from torch import nn

from hpctrain.distributed.comm import Outbox
from hpctrain.distributed.mesh import DEFAULT_TIMEOUT
from hpctrain.ops.linear import WeightGradQueue
from hpctrain.parallel.pipeline.stage import Stage

SPIN_S = 0.5e-3  # the last part of each hold is spun: time.sleep overshoots by 0.1-0.2 ms


def hold(seconds: float) -> None:
    """Take `seconds` of wall time, precisely: sleep all but the last SPIN_S, spin the rest.
    `time.sleep` alone overshoots by 0.15 ms (median, measured on this host: 20 ms sleeps)
    and the vCPU it idled wakes slowly, which the stage's next Python then pays; both are the
    calibration's error, not the runtime's, and the spin removes them."""
    deadline = time.perf_counter() + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < deadline:
        time.sleep(0)  # releases the GIL: the p2p courier thread may need it meanwhile


class _Sleep(torch.autograd.Function):
    """y = x·w; forward sleeps t_f, backward sleeps t_b, the weight gradient sleeps t_w (now, or
    later through `queue` when the stage defers, exactly as hpctrain's LinearFunction does)."""

    @staticmethod
    def forward(ctx, x, w, stage):
        hold(stage.t[0])
        ctx.save_for_backward(x, w)
        ctx.stage = stage
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        stage, queue = ctx.stage, ctx.stage.wgrad_queue
        hold(stage.t[1])

        def weight_grad():
            hold(stage.t[2])
            return (grad * x).sum().reshape(w.shape)

        if queue.deferring:
            def deferred():
                gw = weight_grad()
                w.grad = gw if w.grad is None else w.grad + gw

            queue.put(deferred)
            return grad * w, None, None
        return grad * w, weight_grad(), None


class SleepStage(nn.Module):
    def __init__(self, stage: int, n_stages: int, t: tuple[float, float, float], act_shape):
        super().__init__()
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.t, self.act_shape = t, act_shape
        self.w = nn.Parameter(torch.ones(1))
        self.wgrad_queue = WeightGradQueue()

    def forward(self, x, docs=None):  # docs: the runtime passes boundaries
        if self.is_first:
            x = x.float().reshape(-1, 1, 1).expand(self.act_shape).contiguous()
        return _Sleep.apply(x, self.w, self)


def mean_loss(y: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sleep stages' loss: the last stage's output mean (targets unused)."""
    return y.mean()


class SleepLocal(nn.Module):
    """A rank's sleep stages as the runtime reads them (`parts`, `stages`), like LocalStages."""

    def __init__(self, parts: dict[int, SleepStage]):
        super().__init__()
        self.parts = parts
        self.stages = {s: Stage(s, st, is_first=st.is_first, is_last=st.is_last,
                                wgrad_queue=st.wgrad_queue) for s, st in parts.items()}
        for s, st in parts.items():
            self.add_module(f"stage{s}", st)


def p2p_one_way(rank: int, act_shape, *, rounds: int = 50) -> float:
    """Median one-way latency (s) of one activation message between the two ranks, as the
    runtime sends it on gloo: tagged isend to a receiver whose irecv is already posted
    (ping-pong RTT / 2)."""
    x, box, rtts = torch.zeros(act_shape), Outbox(timeout=DEFAULT_TIMEOUT), []
    peer = 1 - rank
    dist.barrier()
    for _ in range(rounds):
        buf = torch.empty(act_shape)
        work = dist.irecv(buf, src=peer, tag=rank)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            box.send(x, dst=1, tag=1)
            work.wait()
        else:
            work.wait()
            box.send(x, dst=0, tag=0)
        box.wait_all()
        rtts.append(time.perf_counter() - t0)
    lat = torch.tensor([median(rtts) / 2])
    dist.broadcast(lat, src=0)  # rank 0's time is the full round trip
    return float(lat)

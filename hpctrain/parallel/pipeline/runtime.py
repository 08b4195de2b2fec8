"""The pipeline runtime: interprets one rank's lowered action list, in order, and nothing more.

The order, the split of the backward and the placement of sends and receives all come from the
(lowered) `Schedule`; the runtime makes no scheduling decision. Per action:

  F(s, i)       stage s forward of microbatch i; stashes its input (a grad-requiring leaf) and
                output. The last stage computes loss_i / d_i: d_i = m (m microbatches) by
                default, or the caller's real-token weights (hpctrain.parallel.step
                `loss_divisors`), so the summed loss and the gradients are those of the mean
                loss over the whole batch's real tokens.
  B(s, i)       backward of the stash with the stage's WeightGradQueue deferring under tag i:
                only input gradients (and the non-Linear parameters') are computed now.
                With MoE blocks in the stage, their router losses (aux + z) of F(s, i) are
                stashed with the output and seeded here in the same backward call with
                loss_multiplier / d_i: the weight the single process gives them (the data
                engine adds them to micro-batch i's loss before its division by d_i), so each
                stage seeds its own (see "Router losses" below).
  W(s, i)       runs the queued weight gradients of microbatch i.
  BW(s, i)      full backward (nothing deferred).
  SEND_*/RECV_* tagged isend (hpctrain.distributed.comm) / wait on an irecv posted when the step
                began (`_post_recvs`) on gloo, both issued by the runtime's courier thread
                (`comm.Courier`: the calls cost ~0.1 ms each on gloo/TCP); on NCCL
                (`batched=True`) each run of consecutive SEND/RECV actions is one
                `batch_isend_irecv` group (hpctrain.parallel.pipeline.batching says why).
                Received shapes are known: (micro_batch, seq_len, dim) in the params' dtype,
                or under tp without sp a 1/t piece, all-gathered over tp on arrival
                (hpctrain.parallel.pipeline.hop: Megatron's scatter/gather).

A produced tensor goes to a mailbox keyed (kind, receiving stage, microbatch): a SEND takes it
from there, or — when the neighbour stage lives on this rank (zbv) — the next F/B does.
Activations are dropped from the stash as soon as their backward has run.

Router losses: a stage's MoE layers leave aux + z in `MoE.pending_loss` at each training
forward (hpctrain.models.moe.layer); F takes the stage's sum (`take_router_loss`) and stashes it
beside the output; B/BW run `autograd.backward([out, r], [g, loss_multiplier / d_i])` — one
backward over both roots, so gradients are exactly those of (loss_i + r_i) / d_i · multiplier
of the single process, whatever stage the layer lives on. The router's weight and the
experts' stacked weights are not hpctrain Linears: their gradients are computed in B, never
deferred to W (only the split of work changes, not the sums). The reported loss is the LM
loss alone, as in the data-parallel step; the router losses are reported by the moe metrics.
"""

from __future__ import annotations

import datetime
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpctrain.distributed.comm import Courier, Job, Outbox, message_tag, recv
from hpctrain.distributed.mesh import DEFAULT_TIMEOUT
from hpctrain.models.moe.layer import moe_layers, take_router_loss
from hpctrain.ops.documents import split_micro_batch
from hpctrain.parallel.pipeline.actions import Action, ActionKind, Schedule
from hpctrain.parallel.pipeline.batching import comm_groups
from hpctrain.parallel.pipeline.hop import WHOLE, Hop
from hpctrain.parallel.pipeline.lowering import forward_only
from hpctrain.parallel.pipeline.stage import LocalStages
from hpctrain.parallel.step import autocast

K = ActionKind
MicroBatch = tuple  # inputs_BL, targets_BL[, docs] (ops.documents.split_micro_batch)


@dataclass
class PipelineResult:
    loss_sum: torch.Tensor | None  # Σ_i loss_i / d_i in fp64 on the last stage's rank, else None
    timeline: list[tuple[float, float, Action]] = field(default_factory=list)  # compute, seconds


@dataclass
class _Program:
    steps: list  # (handler, action or batched group, timed) in list order
    recvs: list  # (message key, source rank, tag) of the receives posted at the start (gloo)


@dataclass
class _StepState:
    micro_batches: Sequence[MicroBatch]
    start: float
    outbox: Outbox  # this step's sends, waited with the mesh's timeout
    inputs: dict = field(default_factory=dict)  # (stage, mb) → stage input
    outputs: dict = field(default_factory=dict)  # (stage, mb) → output (loss on the last stage)
    router: dict = field(default_factory=dict)  # (stage, mb) → the stage's MoE aux + z loss
    mail: dict = field(default_factory=dict)  # ("F"|"B", receiving stage, mb) → tensor
    posted: dict = field(default_factory=dict)  # message key → (irecv work, buffer), gloo path
    posting: Job | None = None  # the courier's job posting this step's irecvs → `posted`
    divisors: Sequence[float] = ()  # d_i: the last stage's loss_i / d_i
    train: bool = True  # False: forward only (evaluate), nothing stashed
    loss_sum: torch.Tensor | None = None
    timeline: list = field(default_factory=list)


class PipelineRuntime:
    """Runs `schedule.actions[pp_rank]` (lowered) on this rank's `local` stages.

    `peers[r]` is the global rank of pipeline rank r (this rank's pp group, in pp order);
    `act_shape` is (micro_batch, seq_len, dim) of the hidden states passed between stages;
    `hop` how they travel (whole, or scattered over tp and gathered on arrival).
    """

    def __init__(self, schedule: Schedule, local: LocalStages, *, pp_rank: int,
                 peers: Sequence[int], act_shape: tuple[int, int, int],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 precision: str = "fp32", loss_multiplier: float = 1.0, batched: bool = False,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT, hop: Hop = WHOLE):
        self.schedule, self.local, self.pp_rank = schedule, local, pp_rank
        self.timeout = timeout  # every send/receive wait gives up after it
        self.batched = batched
        self.actions = schedule.actions[pp_rank]
        self.peers, self.act_shape, self.precision = list(peers), act_shape, precision
        self.hop, self.wire_shape = hop, hop.wire_shape(act_shape)
        self.loss_multiplier = loss_multiplier
        self.loss_fn = loss_fn  # the last stage's: logits, targets → mean loss
        self._param = next(local.parameters())
        self._handlers = {K.F: self._forward, K.B: self._backward, K.BW: self._backward,
                          K.W: self._weight_grad, K.SEND_F: self._send, K.SEND_B: self._send,
                          K.RECV_F: self._recv, K.RECV_B: self._recv}
        self._eval_programs: dict[int, _Program] = {}  # n microbatches → its F path
        self._moe = {s: moe_layers(stage.module) for s, stage in local.stages.items()}
        # Only a schedule with split backwards (B, later W) defers weight gradients; the other
        # stages' layers take torch's cheaper linear (hpctrain.ops.linear.linear).
        for s, stage in local.stages.items():
            stage.wgrad_queue.may_defer = any(a.kind is K.B and a.stage == s
                                              for a in self.actions)
        # NCCL (batched) issues its p2p in order on the compute thread; gloo's go to the courier
        self._courier = None if batched else Courier(timeout=timeout)
        if self._courier is not None:  # its thread ends with the runtime
            weakref.finalize(self, self._courier.close)
        self._train_program = self._compile(comm_groups(self.actions) if batched
                                            else self.actions)

    @property
    def device(self) -> torch.device:
        """Where the stages' parameters live: read when needed, since the engine gives them
        their memory after this runtime is built (on meta until then)."""
        return self._param.device

    @property
    def dtype(self) -> torch.dtype:
        """Activations travel in the parameters' dtype, read at each use: the data-parallel
        engine casts the parameters to 16 bits (bf16/fp16) after the runtime is built, and a
        receive buffer of another dtype than the sender's tensor corrupts the message."""
        return self._param.dtype

    def step(self, micro_batches: Sequence[MicroBatch], *, start: float | None = None,
             divisors: Sequence[float] | None = None) -> PipelineResult:
        """Execute this rank's actions for one batch of m microbatches; gradients accumulate
        into the stage parameters' `.grad`. Times are relative to `start` (default: now).
        Microbatch i's loss is divided by `divisors[i]` (default m for each)."""
        m = self.schedule.n_microbatches
        if len(micro_batches) != m:
            raise ValueError(f"schedule {self.schedule.name!r} has {m} microbatches but "
                             f"{len(micro_batches)} were given: pass exactly {m}")
        st = _StepState(micro_batches, time.perf_counter() if start is None else start,
                        Outbox(timeout=self.timeout, courier=self._courier),
                        divisors=divisors or [m] * m)
        self._run(st, self._train_program)
        return PipelineResult(st.loss_sum, st.timeline)

    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[MicroBatch], *,
                 divisors: Sequence[float] | None = None) -> torch.Tensor | None:
        """Σ_i loss_i / divisors[i] (fp64; default divisors 1) over 1..m `micro_batches`,
        forward only, on the last stage's rank (None elsewhere): the F actions of this rank's
        lowered list and their sends/receives
        (`lowering.forward_only`), in the schedule's order; nothing is stashed. The forward-only
        list runs unbatched: each pair's sends and receives are in the same (microbatch) order,
        which NCCL's order-matched p2p needs."""
        n = len(micro_batches)
        if not 1 <= n <= self.schedule.n_microbatches:
            raise ValueError(f"evaluate takes 1..{self.schedule.n_microbatches} microbatches, "
                             f"got {n}: split the eval batches into chunks of at most m")
        if n not in self._eval_programs:
            self._eval_programs[n] = self._compile(forward_only(self.actions, microbatches=n))
        st = _StepState(micro_batches, time.perf_counter(),
                        Outbox(timeout=self.timeout, courier=self._courier),
                        divisors=divisors or [1] * n, train=False)
        self._run(st, self._eval_programs[n])
        return st.loss_sum

    def _compile(self, items) -> _Program:
        """Per item its handler, its argument and whether it is timed, and the receives to post
        (gloo): what an action needs is decided once per list, not per action and step — a
        SEND/RECV gets its message (mail key, peer rank, tag) precomputed (profiled: handler,
        kind and tag lookups were a quarter of the runtime's own time per action)."""
        comm = (K.SEND_F, K.SEND_B, K.RECV_F, K.RECV_B)
        steps = [(self._exchange, item, False) if isinstance(item, tuple)
                 else (self._handlers[item.kind], self._message(item), False)
                 if item.kind in comm
                 else (self._handlers[item.kind], item, item.kind.is_compute) for item in items]
        # NCCL serialises p2p on one stream: receives posted early would block its sends
        recvs = [] if self.batched else [self._message(a) for a in items
                                         if a.kind in (K.RECV_F, K.RECV_B)]
        return _Program(steps, recvs)

    def _run(self, st: _StepState, program: _Program) -> None:
        if program.recvs:
            self._post_recvs(st, program.recvs)
        clock, start, timeline = time.perf_counter, st.start, st.timeline
        for handler, item, timed in program.steps:
            if timed:
                t0 = clock() - start
                handler(st, item)
                timeline.append((t0, clock() - start, item))
            else:
                handler(st, item)
        st.outbox.wait_all()
        self._check_drained(st)

    def _check_drained(self, st: _StepState) -> None:
        queued = {s: len(stage.wgrad_queue) for s, stage in self.local.stages.items()}
        left = {"stashed activations": len(st.outputs) + len(st.router),
                "undelivered messages": len(st.mail),
                "unreceived messages": len(st.posted),
                "queued weight gradients": sum(queued.values())}
        if any(left.values()):
            raise RuntimeError(f"schedule {self.schedule.name!r} rank {self.pp_rank} ended the "
                               f"step with {left}: the action list is incomplete")

    # -- compute ---------------------------------------------------------------------------
    def _forward(self, st: _StepState, a: Action) -> None:
        stage, key = self.local.stages[a.stage], (a.stage, a.microbatch)
        inputs_BL, targets_BL, docs = split_micro_batch(st.micro_batches[a.microbatch])
        docs = None if docs is None else docs.to(self.device)
        if stage.is_first:
            x = inputs_BL.to(self.device)
        else:
            x = st.mail.pop(("F", a.stage, a.microbatch)).requires_grad_()
        with autocast(self.precision, self.device):
            out = stage.module(x, docs=docs)
            if stage.is_last:
                out = self.loss_fn(out, targets_BL.to(self.device))
        if stage.is_last:
            loss = out / st.divisors[a.microbatch]
            st.loss_sum = loss.detach().double() + (0 if st.loss_sum is None else st.loss_sum)
            # no scaling (fp32/bf16): no extra node to run forward and backward per micro-batch
            out = loss if self.loss_multiplier == 1.0 else loss * self.loss_multiplier
        else:
            st.mail["F", a.stage + 1, a.microbatch] = out.detach()
        if st.train:
            st.inputs[key], st.outputs[key] = x, out
            router = take_router_loss(self._moe[a.stage]) if self._moe[a.stage] else None
            if router is not None:  # None without MoE (eval: no_grad, none left)
                st.router[key] = router

    def _backward(self, st: _StepState, a: Action) -> None:
        stage, key = self.local.stages[a.stage], (a.stage, a.microbatch)
        x, out = st.inputs.pop(key), st.outputs.pop(key)
        grad = None if stage.is_last else st.mail.pop(("B", a.stage, a.microbatch))
        roots, seeds = [out], [grad]
        router = st.router.pop(key, None)
        if router is not None:  # weighted as the LM loss of micro-batch i (module docstring)
            roots.append(router)
            seeds.append(torch.full_like(router, self.loss_multiplier
                                         / st.divisors[a.microbatch]))
        queue = stage.wgrad_queue
        queue.deferring, queue.tag = a.kind is K.B, a.microbatch
        try:
            torch.autograd.backward(roots, grad_tensors=seeds)
        finally:
            queue.deferring, queue.tag = False, None
        if not stage.is_first:
            st.mail["B", a.stage - 1, a.microbatch] = x.grad

    def _weight_grad(self, st: _StepState, a: Action) -> None:
        self.local.stages[a.stage].wgrad_queue.run(a.microbatch)

    # -- communication ---------------------------------------------------------------------
    def _route(self, a: Action) -> tuple[str, int, int]:
        """(message kind, receiving stage, peer stage) of a SEND/RECV action."""
        if a.kind is K.SEND_F:
            return "F", a.stage + 1, a.stage + 1
        if a.kind is K.SEND_B:
            return "B", a.stage - 1, a.stage - 1
        if a.kind is K.RECV_F:
            return "F", a.stage, a.stage - 1
        return "B", a.stage, a.stage + 1

    def _message(self, a: Action) -> tuple[tuple[str, int, int], int, int]:
        """(mail key, peer global rank, tag) of a SEND/RECV action; the key is (message kind,
        receiving stage, microbatch) on both sides."""
        kind, to_stage, peer_stage = self._route(a)
        tag = message_tag(kind, stage=to_stage, microbatch=a.microbatch,
                          n_stages=self.schedule.n_stages)
        return (kind, to_stage, a.microbatch), self._peer(peer_stage), tag

    def _send(self, st: _StepState, message) -> None:
        key, dst, tag = message
        st.outbox.send(self.hop.outgoing(st.mail.pop(key)), dst=dst, tag=tag)

    def _post_recvs(self, st: _StepState, recvs) -> None:
        """Post every receive of the list up front (tagged irecv: each message has its own
        tag). A message then lands while this rank still computes, not when it reaches the
        RECV, so the receiver's readiness handshake leaves the critical path (profiled: the
        blocking recv's post-and-wait was most of the per-hop overhead). The courier posts
        them while the first actions run (posting all at once cost 0.4–4 ms before them)."""
        bufs = [torch.empty(self.wire_shape, dtype=self.dtype, device=self.device)
                for _ in recvs]
        st.posting = self._courier.submit(lambda: {
            key: (dist.irecv(buf, src=src, tag=tag), buf)
            for (key, src, tag), buf in zip(recvs, bufs, strict=True)})

    def _recv(self, st: _StepState, message) -> None:
        key, src, tag = message
        if st.posting is not None:
            st.posted.update(self._courier.result(st.posting, what="the step's receives"))
            st.posting = None
        if key not in st.posted:  # NCCL's forward-only eval: a blocking recv in list order
            buf = recv(self.wire_shape, dtype=self.dtype, device=self.device, src=src, tag=tag,
                       timeout=self.timeout)
        else:
            work, buf = st.posted.pop(key)
            work.wait(self.timeout)
        st.mail[key] = self.hop.incoming(buf, self.act_shape)

    def _exchange(self, st: _StepState, group: tuple[Action, ...]) -> None:
        """One batched group of sends and receives; returns when all of them completed."""
        ops, received = [], []
        for a in group:
            kind, to_stage, peer_stage = self._route(a)
            tag = message_tag(kind, stage=to_stage, microbatch=a.microbatch,
                              n_stages=self.schedule.n_stages)
            peer = self._peer(peer_stage)
            if a.kind in (K.SEND_F, K.SEND_B):
                payload = self.hop.outgoing(st.mail.pop((kind, to_stage, a.microbatch)))
                ops.append(dist.P2POp(dist.isend, payload.detach().contiguous(), peer, tag=tag))
            else:
                buf = torch.empty(self.wire_shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer, tag=tag))
                received.append(((kind, to_stage, a.microbatch), buf))
        for work in dist.batch_isend_irecv(ops):
            work.wait(self.timeout)
        st.mail.update((key, self.hop.incoming(buf, self.act_shape)) for key, buf in received)

    def _peer(self, stage: int) -> int:
        return self.peers[self.schedule.stage_to_rank[stage]]


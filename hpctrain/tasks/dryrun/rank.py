"""One rank of a job set up for real, on meta tensors, in this process: what it would hold.

`measure_rank(cfg, rank)` joins a fake world of the job's full size as `rank`
(`hpctrain.distributed.fake`), builds the mesh (every process group of every axis, the
checkpoint writer's too) and runs the trainer's own set-up (`hpctrain.train.setup`) under
`torch.device("meta")`: the model of this rank's pipeline stages, tensor/context/expert
sharding, FP8, activation checkpointing, the flat data-parallel engine with its ZeRO units
and optimizer state. Then one training step's micro-batches go forward and backward on meta
tokens (shapes only; `DataParallel.accumulate`, or the pipeline runtime's schedule with its
point-to-point messages) under the trainer's `ActivationMeter`, and the gradient reduction
runs. No byte is allocated: every figure is the storage the real run's tensors would have.

Measured as the trainer measures (the engine's ledger, `train.ckpt_shards.owned_bytes`):
  params, grads, optim   the engine's units between steps (optim on the host under offload)
  gathered               ZeRO-3's gathered units at their most over the step (the engine's
                         ledger: mem_gathered_peak_bytes, read from the units' storages)
  buffers                the modules' registered buffers (FP8 scales and amax histories)
  activations            the peak of saved-for-backward bytes over the step's schedule
  checkpoint             this rank's own chunks of the master weights and both moments
  setup_host             the host transient of its set-up beyond the above: one full parameter
                         in fp32 (`hpctrain.checkpoint.initial`; the model is built on meta)
What meta tensors cannot show: routed experts' token counts depend on the router's choices,
which meta tensors do not make, so a dry run routes at the planner's bound
(`hpctrain.models.moe.router.bound_routing`: dropless, T·k/E slots an expert; with a capacity, every
expert full), the same on every rank (the all-to-all's splits follow); autocast does not act
on meta tensors, so bf16 runs keep their 16-bit parameters' dtype everywhere.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from hpctrain.checkpoint.initial import largest_parameter_bytes
from hpctrain.checkpoint.shards import owned_bytes
from hpctrain.config.schema import Config
from hpctrain.distributed.fake import BACKEND, fake_world
from hpctrain.distributed.mesh import build_mesh
from hpctrain.metrics.activations import ActivationMeter
from hpctrain.parallel.context.step import shard_batches
from hpctrain.tasks.dryrun.comm import CommTally, GroupTally
from hpctrain.train.setup import build_parallel_state
from hpctrain.train.tensor_parallel import tp_step_hooks

META = torch.device("meta")


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds (module docstring); `host`: offloaded optimizer state."""

    params: int
    grads: int
    optim: int
    gathered: int
    buffers: int
    activations: int
    checkpoint: int
    host: int = 0
    setup_host: int = 0

    @property
    def device_total(self) -> int:
        return (self.params + self.grads + self.optim + self.gathered + self.buffers
                + self.activations)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def meta_micro_batches(cfg: Config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step's micro-batches of this data-parallel rank: (inputs, targets) token rows of
    train.micro_batch_size × train.seq_len, whole rows (no document boundaries)."""
    t = cfg.train
    shape = (t.micro_batch_size, t.seq_len)
    return [(torch.empty(shape, dtype=torch.long, device=META),
             torch.empty(shape, dtype=torch.long, device=META)) for _ in range(cfg.grad_accum)]


def measure_rank(cfg: Config, rank: int) -> tuple[RankBytes, dict[str, float],
                                                 dict[str, GroupTally]]:
    """`rank`'s bytes (module docstring), the seconds its set-up and step took, and the
    collectives its step issued per process group (`plan.dryrun_comm`)."""
    dims = cfg.parallel.dims
    with fake_world(rank, dims.world_size):
        t0 = time.perf_counter()
        mesh = build_mesh(dims, rank=rank, device=META, io_backend=BACKEND)
        t1 = time.perf_counter()
        with torch.device(META):
            state, pipeline = build_parallel_state(cfg, mesh)
        t2 = time.perf_counter()
        with CommTally(mesh) as tally:
            acts = _step_activations(cfg, state, pipeline, mesh)
        engine = state.engine
        engine.optimizer.zero_grad()
        if engine.zero3 is not None:
            engine.zero3.free_all()
        ledger = engine.ledger()
        measured = RankBytes(
            params=ledger["mem_params_bytes"], grads=ledger["mem_grads_bytes"],
            optim=ledger["mem_optim_bytes"],
            gathered=ledger.get("mem_gathered_peak_bytes", 0),
            buffers=ledger["mem_buffers_bytes"],
            activations=acts, checkpoint=owned_bytes(state),
            host=ledger["mem_optim_host_bytes"], setup_host=largest_parameter_bytes(state))
        t3 = time.perf_counter()
    return measured, {"mesh_s": t1 - t0, "setup_s": t2 - t1, "step_s": t3 - t2}, tally.groups


def _step_activations(cfg: Config, state, pipeline, mesh) -> int:
    """Peak saved-for-backward bytes of one step on meta tokens; the reduction and the
    optimizer step's parameter all-gathers follow (its update and its scalar agreements, the
    gradient norm and the overflow check, need values: they do not run on meta)."""
    engine, n = state.engine, cfg.grad_accum
    micro = list(shard_batches(meta_micro_batches(cfg), group=mesh.group("cp")))
    meter = ActivationMeter(engine.parameter_tensors())
    with meter:
        if pipeline is None:
            engine.accumulate(micro, divisors=[1.0] * n, n_micro=n,
                              precision=cfg.train.precision,
                              **tp_step_hooks(state.model, state.tp_plan))
        else:
            with engine.reducer.no_sync():
                pipeline.runtime.step(micro, start=time.perf_counter(), divisors=[1.0] * n)
    engine.reduce()
    for unit in engine.units:
        if unit.zero < 3:
            unit.all_gather_params(unit.group)
    return meter.peak_bytes

"""Layout: one way of splitting a training job (dp × tp × pp, ZeRO stage, schedule), and the
divisibility rules that make it valid for a model and a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

from hpctrain.distributed.dims import ParallelDims
from hpctrain.parallel.pipeline import schedules
from hpctrain.parallel.tensor.plan import unsplit

Precision = Literal["fp32", "bf16", "fp16"]
Recompute = Literal["none", "selective", "full"]
Offload = Literal["none", "cpu"]
CpComm = Literal["ring", "allgather"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
SCHEDULES: tuple[str, ...] = tuple(schedules.SCHEDULES)
INTERLEAVED = schedules.INTERLEAVED


@dataclass(frozen=True)
class Layout:
    """dp·tp·pp ranks; `virtual_stages` model chunks per pipeline rank (interleaved schedules);
    ZeRO stage 0–3 over dp; optimizer `offload`; sequence parallelism `sp` inside tp groups;
    routed experts sharded over `ep` consecutive dp ranks (ep divides dp; no extra ranks)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    zero: int = 0
    offload: Offload = "none"
    sp: bool = False
    schedule: str = "1f1b"
    cp: int = 1  # context parallelism: each sequence split over cp ranks (ring attention)
    ep: int = 1  # expert parallelism inside dp (hpctrain.plan.experts)
    cp_comm: CpComm = "ring"  # how key/value shards travel under cp > 1 (parallel.cp_comm)
    dp_replicate: int = 1  # HSDP: ZeRO shards over dp / dp_replicate (hpctrain.distributed.dims)

    def __post_init__(self) -> None:
        _ = self.dims  # raises unless degrees >= 1 and ep, dp_replicate divide what they must
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero} must be one of 0, 1, 2, 3")
        if self.offload not in ("none", "cpu"):
            raise ValueError(f"offload={self.offload!r} must be 'none' or 'cpu'")
        if self.cp_comm not in ("ring", "allgather"):
            raise ValueError(f"cp_comm={self.cp_comm!r} must be 'ring' or 'allgather'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is unknown; choose one of {SCHEDULES}")
        v = self.virtual_stages
        if self.schedule == "zbv" and v != 2:
            raise ValueError(f"schedule='zbv' places 2 chunks per rank; got virtual_stages={v}")
        if self.schedule not in INTERLEAVED and v != 1:
            raise ValueError(
                f"virtual_stages={v} needs an interleaved schedule ({INTERLEAVED}), "
                f"not {self.schedule!r}: set virtual_stages=1"
            )

    @property
    def dims(self) -> ParallelDims:
        """The degrees and rank order (the same type the run's mesh is built from)."""
        return ParallelDims(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                            dp_replicate=self.dp_replicate)

    @property
    def n_devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @classmethod
    def of(cls, parallel) -> Layout:
        """The layout a `ParallelConfig` runs: every field of Layout is a key of
        `parallel.*` of the same name (tests/unit/test_layout_once.py holds them together);
        the schedule and virtual stages as the runtime uses them (none without pp)."""
        kw = {f.name: getattr(parallel, f.name) for f in fields(cls)}
        pipelined = parallel.pp > 1
        kw["virtual_stages"] = (1 if not pipelined else 2 if parallel.schedule == "zbv"
                                else parallel.virtual_stages)
        kw["schedule"] = parallel.schedule if pipelined else "1f1b"
        return cls(**kw)

    def applied_to(self, parallel):
        """`parallel` (a ParallelConfig) running this layout: every field replaced, derived
        keys (dp_shard, microbatches) reset to their defaults."""
        return replace(parallel, **{f.name: getattr(self, f.name) for f in fields(self)},
                       dp_shard=None, microbatches=None)

    def describe(self) -> str:
        """Short label, e.g. 'dp4 tp2 pp2 v1 z1 1f1b sp'."""
        extras = (" sp" if self.sp else "") + (" offload" if self.offload == "cpu" else "")
        extras += f" cp{self.cp}" if self.cp > 1 else ""
        extras += f" ep{self.ep}" if self.ep > 1 else ""
        extras += f" hsdp{self.dp_replicate}x{self.dp // self.dp_replicate}" \
            if self.dp_replicate > 1 else ""
        extras += " allgather" if self.cp > 1 and self.cp_comm == "allgather" else ""
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp} v{self.virtual_stages} z{self.zero} "
            f"{self.schedule}{extras}"
        )


def num_microbatches(global_batch: int, *, micro_batch_size: int, dp: int) -> int:
    """m = global_batch / (micro_batch_size · dp): microbatches each pipeline runs per step."""
    per_step = micro_batch_size * dp
    if global_batch % per_step:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by micro_batch_size={micro_batch_size}"
            f" × dp={dp} = {per_step}: choose a global batch that is a multiple of {per_step}"
        )
    return global_batch // per_step


def layout_problems(
    model, layout: Layout, *, global_batch: int, micro_batch_size: int
) -> list[str]:
    """Reasons `layout` cannot run `model` (empty when valid): heads % tp, layers % (pp·v),
    global batch % (mbs·dp), interleaved schedules needing m % pp == 0 (Megatron's rule), and
    experts % ep (ep > 1 only for a model with routed experts)."""
    problems = []
    moe = getattr(model, "moe", None)
    experts = moe.num_experts if moe is not None else 0
    if layout.ep > 1 and experts == 0:
        problems.append(f"ep={layout.ep} needs routed experts (model.moe.num_experts=0): ep=1")
    elif layout.ep > 1 and experts % layout.ep:
        problems.append(f"ep={layout.ep} does not divide num_experts={experts}")
    for name in unsplit(model, layout.tp, ("n_heads", "n_kv_heads")):  # the tp plan's rule
        value = getattr(model, name)
        problems.append(f"n_heads={value} not divisible by tp={layout.tp}" if name == "n_heads"
                        else f"n_kv_heads={value} and tp={layout.tp}: neither divides the other")
    chunks = layout.pp * layout.virtual_stages
    if model.n_layers % chunks:
        problems.append(f"n_layers={model.n_layers} not divisible by pp×v={chunks}")
    per_step = micro_batch_size * layout.dp
    if global_batch % per_step:
        problems.append(f"global_batch={global_batch} not divisible by mbs×dp={per_step}")
    elif layout.schedule == "interleaved_1f1b" and (global_batch // per_step) % layout.pp:
        problems.append(f"interleaved_1f1b needs microbatches % pp == 0 (pp={layout.pp})")
    return problems


def check_layout(model, layout: Layout, *, global_batch: int, micro_batch_size: int) -> None:
    """Raise a ValueError listing every problem `layout_problems` finds."""
    problems = layout_problems(
        model, layout, global_batch=global_batch, micro_batch_size=micro_batch_size
    )
    if problems:
        raise ValueError(f"layout {layout.describe()} is invalid: " + "; ".join(problems))

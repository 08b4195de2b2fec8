"""Cross-field validation of a Config: every user mistake becomes one ValueError before launch.

Each check returns a list of messages; `validate` runs them all and raises a single error that
lists every problem with the keys, the values and the fix.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable

from hpctrain.config import Config

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINTING = ("none", "selective", "full")
ONE_F_ONE_B_FAMILY = ("1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv")
TASKS = ("train", "simulate", "bench", "plan")
ON_NONFINITE = ("stop", "skip", "rollback")  # hpctrain.train.nonfinite
Check = Callable[[Config], list[str]]


def _choice(key: str, value, allowed) -> list[str]:
    if value in allowed:
        return []
    return [f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}"]


def check_choices(c: Config) -> list[str]:
    from hpctrain.ops.attention import ATTENTION_BACKENDS
    from hpctrain.parallel.pipeline.schedules import SCHEDULES

    return [
        *_choice("task", c.task, TASKS),
        *_choice("model.attention", c.model.attention, tuple(ATTENTION_BACKENDS)),
        *_choice("parallel.schedule", c.parallel.schedule, tuple(SCHEDULES)),
        *_choice("train.precision", c.train.precision, PRECISIONS),
        *_choice("train.activation_checkpointing", c.train.activation_checkpointing, CHECKPOINTING),
        *_choice("train.on_nonfinite", c.train.on_nonfinite, ON_NONFINITE),
        *_choice("cluster.launcher", c.cluster.launcher, ("local", "slurm")),
        *_choice("cluster.device", c.cluster.device, ("auto", "cpu", "cuda")),
        *_choice("cluster.backend", c.cluster.backend, ("auto", "gloo", "nccl")),
        *_choice("data.source", c.data.source, ("stdlib", "files", "tokens")),
        *_choice("data.tokenizer", c.data.tokenizer, ("byte", "bpe")),
        *_choice("logger.wandb", c.logger.wandb, ("auto", "online", "offline", "disabled")),
        *_choice("logger.progress", c.logger.progress, ("auto", "rich", "plain")),
        *_choice("optim.lr_schedule", c.optim.lr_schedule, ("cosine", "constant")),
        *_choice("parallel.offload", c.parallel.offload, ("none", "cpu")),
        *_choice("parallel.zero", c.parallel.zero, (0, 1, 2, 3)),
        *_choice("parallel.grad_comm_dtype", c.parallel.grad_comm_dtype, PRECISIONS),
    ]


def check_positive(c: Config) -> list[str]:
    keys = {
        "train.steps": c.train.steps, "train.global_batch_size": c.train.global_batch_size,
        "train.micro_batch_size": c.train.micro_batch_size, "train.seq_len": c.train.seq_len,
        "train.log_every": c.train.log_every, "cluster.nodes": c.cluster.nodes,
        "cluster.procs_per_node": c.cluster.procs_per_node, "parallel.dp": c.parallel.dp,
        "parallel.tp": c.parallel.tp, "parallel.pp": c.parallel.pp,
        "parallel.virtual_stages": c.parallel.virtual_stages, "optim.lr": c.optim.lr,
        "cluster.timeout_s": c.cluster.timeout_s, "model.n_layers": c.model.n_layers,
    }
    return [f"{k}={v} must be > 0" for k, v in keys.items() if not v > 0]


def check_world(c: Config) -> list[str]:
    p, world = c.parallel, c.cluster.world_size
    if p.world_size == world:
        return []
    fix = "set parallel.dp so that dp × tp × pp equals the job's ranks"
    if world % (p.tp * p.pp) == 0:
        fix = f"set parallel.dp={world // (p.tp * p.pp)}"
    return [
        f"parallel.pp={p.pp} × parallel.tp={p.tp} × parallel.dp={p.dp} = {p.world_size} ranks, "
        f"but cluster.nodes={c.cluster.nodes} × cluster.procs_per_node="
        f"{c.cluster.procs_per_node} = {world}: {fix}"
    ]


def check_model_shape(c: Config) -> list[str]:
    m, tp, errs = c.model, c.parallel.tp, []
    if m.dim % m.n_heads:
        errs.append(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
    if m.n_heads % m.n_kv_heads:
        errs.append(f"model.n_heads={m.n_heads} is not divisible by "
                    f"model.n_kv_heads={m.n_kv_heads}: choose kv heads that divide the heads")
    if m.n_heads % tp:
        errs.append(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}: "
                    "choose tp among the divisors of the head count")
    if m.n_kv_heads % tp and tp % m.n_kv_heads:
        errs.append(f"model.n_kv_heads={m.n_kv_heads} and parallel.tp={tp}: kv heads must be "
                    "divisible by tp (split) or divide tp (replicated)")
    if m.ffn_dim % tp:
        errs.append(f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={tp}: "
                    "choose an ffn_dim that is a multiple of tp")
    if m.vocab_size % tp:
        errs.append(f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={tp}: "
                    "pad the vocabulary to a multiple of tp")
    stages = c.parallel.pp * c.parallel.virtual_stages
    if c.parallel.schedule == "zbv":  # always 2 chunks per rank
        stages = 2 * c.parallel.pp
    if m.n_layers % stages:
        errs.append(f"model.n_layers={m.n_layers} is not divisible by the {stages} pipeline "
                    f"stages of parallel.pp={c.parallel.pp}, parallel.schedule="
                    f"{c.parallel.schedule}, parallel.virtual_stages={c.parallel.virtual_stages}:"
                    f" choose pp and virtual_stages whose product divides the layer count")
    if c.train.seq_len > m.max_seq_len:
        errs.append(f"train.seq_len={c.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}:"
                    f" lower train.seq_len or raise model.max_seq_len")
    if c.parallel.sp and c.train.seq_len % tp:
        errs.append(f"train.seq_len={c.train.seq_len} is not divisible by parallel.tp={tp}, "
                    "required by parallel.sp=true: choose a seq_len that is a multiple of tp "
                    "or set parallel.sp=false")
    return errs


def check_batch(c: Config) -> list[str]:
    t, p = c.train, c.parallel
    per_step = t.micro_batch_size * p.dp
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        return [f"train.global_batch_size={t.global_batch_size} is not divisible by "
                f"train.micro_batch_size={t.micro_batch_size} × parallel.dp={p.dp} = "
                f"{per_step}: use a multiple such as {lo}"]
    m = c.grad_accum
    if p.microbatches is not None and p.microbatches != m:
        return [f"parallel.microbatches={p.microbatches} but train.global_batch_size / "
                f"(micro_batch_size × dp) = {m}: leave parallel.microbatches unset or match it"]
    if p.pp > 1 and p.schedule in ONE_F_ONE_B_FAMILY and m < p.pp:
        return [f"parallel.schedule={p.schedule} needs microbatches ({m}) ≥ parallel.pp="
                f"{p.pp}: raise train.global_batch_size or lower train.micro_batch_size"]
    return []


def check_data(c: Config) -> list[str]:
    d = c.data
    if d.source == "stdlib":
        return []
    if not d.paths:
        return [f"data.source={d.source} needs data.paths (files or globs)"]
    missing = [p for p in d.paths if not glob.glob(os.path.expanduser(p))]
    if missing:
        return [f"data.paths: no file matches {', '.join(missing)}"]
    if d.tokenizer == "bpe" and d.bpe_vocab_size > c.model.vocab_size:
        return [f"data.bpe_vocab_size={d.bpe_vocab_size} exceeds model.vocab_size="
                f"{c.model.vocab_size}"]
    return []


def check_device(c: Config) -> list[str]:
    from hpctrain.distributed.device import cuda_available, resolve_device_type

    if c.cluster.launcher == "slurm" and "SLURM_PROCID" not in os.environ:
        return []  # submitting from a login node: the devices are checked in each Slurm task
    device = resolve_device_type(c.cluster.device)
    if device == "cuda" and not cuda_available():
        return ["cluster.device=cuda but no CUDA device is visible: use cluster.device=auto"]
    if c.cluster.backend == "nccl" and device != "cuda":
        return ["cluster.backend=nccl needs CUDA devices: use cluster.backend=auto (gloo on CPU)"]
    if c.train.precision == "fp16" and device == "cpu":
        if not c.train.allow_slow_precision:
            return ["train.precision=fp16 on CPU is ~100× slower than bf16: use "
                    "train.precision=bf16 or fp32 (or train.allow_slow_precision=true)"]
        log.warning("train.precision=fp16 on CPU: expect it to be very slow")
    return []


def check_not_built(c: Config) -> list[str]:
    """Degrees whose implementation has not landed are refused, never silently ignored."""
    p = c.parallel
    # Benchmarks other than bench=train only build the layout's process groups, never a model.
    groups_only = c.task == "bench" and (c.extra.get("bench") or {}).get("name") != "train"
    # ZeRO 0-2 compose with tp and pp, ZeRO-3 with tp (the engine works on local parameters);
    # what is not built or not tested together is refused.
    todo = {f"parallel.zero={p.zero} with parallel.pp={p.pp} (ZeRO-3 gathers per transformer "
            "block of a whole model, not per pipeline stage)":
            (p.zero == 3 and p.pp > 1, "use parallel.zero=1 or 2 with pipeline parallelism"),
            f"parallel.offload={p.offload!r} / parallel.grad_comm_dtype={p.grad_comm_dtype!r} "
            f"with parallel.tp={p.tp} or parallel.pp={p.pp}":
            ((p.offload != "none" or p.grad_comm_dtype != "fp32") and (p.tp > 1 or p.pp > 1),
             "leave offload=none and grad_comm_dtype=fp32 with tp or pp")}
    return [f"{k} is not implemented yet in this version of hpctrain: {fix}"
            for k, (on, fix) in todo.items() if on and not groups_only]


def check_bench(c: Config) -> list[str]:
    from hpctrain.bench.config import check_bench as check

    return check(c)


def check_pipeline(c: Config) -> list[str]:
    """pp > 1: the schedule must build for (pp, microbatches, virtual_stages), and the features
    the pipeline runtime does not combine with yet are refused."""
    p = c.parallel
    if p.pp == 1:
        if p.virtual_stages != 1 or p.timeline:
            return ["parallel.virtual_stages and parallel.timeline need parallel.pp > 1: "
                    "set parallel.pp or leave them at their defaults (1, false)"]
        return []
    from hpctrain.parallel.pipeline.schedules import build_schedule

    errs = []
    try:
        schedule = build_schedule(p.schedule, pp=p.pp, microbatches=c.grad_accum,
                                  virtual_stages=p.virtual_stages)
        errs += _nccl_p2p_problems(c, schedule)
    except ValueError as err:
        errs.append(str(err))
    if c.model.tied_embeddings:
        errs.append("model.tied_embeddings=true cannot be split across pipeline stages: set "
                    "model.tied_embeddings=false or parallel.pp=1")
    if c.train.activation_checkpointing != "none":
        errs.append(f"train.activation_checkpointing={c.train.activation_checkpointing} is not "
                    "implemented with parallel.pp > 1 yet: set it to none")
    return errs


def _nccl_p2p_problems(c: Config, schedule) -> list[str]:
    """On NCCL, p2p is matched by order and runs in batched groups: the lowered schedule must
    complete under those rules (hpctrain.parallel.pipeline.batching)."""
    from hpctrain.distributed.device import resolve_device_type
    from hpctrain.parallel.pipeline.batching import check_batched
    from hpctrain.parallel.pipeline.lowering import lower_comm

    backend = c.cluster.backend
    if backend == "auto":
        backend = "nccl" if resolve_device_type(c.cluster.device) == "cuda" else "gloo"
    if backend != "nccl":
        return []
    try:
        check_batched(lower_comm(schedule))
    except ValueError as err:
        return [f"{err} (parallel.pp={c.parallel.pp}, microbatches={c.grad_accum}): on NCCL "
                "use parallel.schedule=1f1b, zb_h1 or gpipe, or another microbatch count"]
    return []


def _errors_of(c: Config, *builders) -> list[str]:
    """Run builders that raise ValueError on bad input; collect their messages."""
    errs = []
    for build in builders:
        try:
            build(c)
        except ValueError as err:
            errs.append(str(err))
    return errs


def check_simulate(c: Config) -> list[str]:
    """task=simulate: the schedule and the simulate.* costs."""
    from hpctrain.parallel.pipeline.sim_task import simulate_costs, simulated_schedule

    return _errors_of(c, simulated_schedule, simulate_costs)


def check_plan(c: Config) -> list[str]:
    """task=plan: the plan.* settings and the cluster's accelerator and links."""
    from hpctrain.plan.task import cluster_spec, plan_settings

    return _errors_of(c, plan_settings, cluster_spec)


CHECKS: tuple[Check, ...] = (check_choices, check_positive, check_world, check_model_shape,
                             check_batch, check_data, check_device, check_not_built,
                             check_pipeline, check_bench)
# task=simulate runs no ranks, trains nothing: only the schedule and its costs matter.
TASK_CHECKS: dict[str, tuple[Check, ...]] = {
    "simulate": (check_choices, check_positive, check_simulate),
    # The planner predicts any layout, including ones this version cannot run yet.
    "plan": (check_choices, check_positive, check_world, check_model_shape, check_batch,
             check_plan),
}


def validate(c: Config) -> None:
    errors = [e for check in TASK_CHECKS.get(c.task, CHECKS) for e in check(c)]
    if errors:
        bullet = "\n  - "
        raise ValueError(f"invalid configuration ({len(errors)} problem(s)):{bullet}"
                         + bullet.join(errors))

"""Validation of a Config: every user mistake becomes one ValueError before launch.

Two stages. Key-level checks (types in `config.collect`, choices and ranges in
`validate_keys`, paths in `validate_inputs`) each report the key they are about. Cross-field
checks then run unless a key they read was already reported (`DERIVED`: check → keys it reads),
so none divides by zero, suggests a fix built from a bad value, or repeats a problem.
`validate` raises one ValueError listing every problem once, each with its fix.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from hpctrain.bench.config import check_bench as bench_problems
from hpctrain.bench.config import needs_data
from hpctrain.config import Config
from hpctrain.config_build import Problem, format_problems
from hpctrain.distributed.device import cuda_available, resolve_device_type
from hpctrain.ops.attention import backend_problem
from hpctrain.plan.dryrun_config import chosen_ranks
from hpctrain.plan.task import cluster_spec, plan_cluster, plan_settings
from hpctrain.train.eval_set import eval_split_problem
from hpctrain.train.optim import wsd_decay_steps
from hpctrain.validate_cp import check_cp
from hpctrain.validate_inputs import (
    check_cache_dir,
    check_data_paths,
    check_data_size,
    check_format,
    check_model_tokenizer,
    check_resume,
    check_tokenizer,
    check_vocab,
)
from hpctrain.validate_keys import choice_problems, config_range_problems, plan_setting_problems
from hpctrain.validate_layout import check_elastic, check_hsdp, check_local_nodes, check_world
from hpctrain.validate_moe import check_moe
from hpctrain.validate_once import (
    check_eval_task,
    check_export,
    check_export_every,
    check_generate,
)
from hpctrain.validate_pipeline import (
    ONE_F_ONE_B_FAMILY,
    _errors_of,
    check_pipeline,
    check_schedule,
    check_simulate,
)

log = logging.getLogger(__name__)

Check = Callable[[Config], list[str]]


def check_signal_delay(c: Config) -> list[str]:
    """Slurm sends its warning signal (save, then requeue) signal_delay_s before the limit."""
    cl = c.cluster
    if cl.launcher != "slurm" or cl.signal_delay_s < cl.time_min * 60:
        return []
    return [f"cluster.signal_delay_s={cl.signal_delay_s} is not below cluster.time_min="
            f"{cl.time_min} minutes = {cl.time_min * 60} s: lower cluster.signal_delay_s or "
            f"raise cluster.time_min to {cl.signal_delay_s // 60 + 1} or more"]


def check_optim(c: Config) -> list[str]:
    """A decaying schedule decays down to min_lr, not up."""
    o = c.optim
    if o.lr_schedule not in ("cosine", "linear", "wsd") or o.min_lr <= o.lr:
        return []
    return [f"optim.min_lr={o.min_lr:g} exceeds optim.lr={o.lr:g}: the {o.lr_schedule} schedule "
            f"decays from lr to min_lr, so the LR would climb to {o.min_lr / o.lr:.3g}× its "
            f"peak; set optim.min_lr at most optim.lr, e.g. optim.min_lr={o.lr / 10:g}"]


def check_lr_schedule(c: Config) -> list[str]:
    """inv_sqrt has a warmup; the wsd decay does not overlap the warmup."""
    o, steps = c.optim, c.train.steps
    if o.lr_schedule == "inv_sqrt" and o.warmup_steps < 1:
        return ["optim.lr_schedule=inv_sqrt is lr·sqrt(warmup/step) and needs "
                "optim.warmup_steps ≥ 1: set e.g. optim.warmup_steps=20"]
    decay = wsd_decay_steps(o, steps)
    if o.lr_schedule != "wsd" or steps - decay >= o.warmup_steps:
        return []
    most = (steps - o.warmup_steps) / steps
    return [f"optim.decay_fraction={o.decay_fraction:g} of train.steps={steps} is {decay} decay "
            f"steps, which overlap the optim.warmup_steps={o.warmup_steps}: set "
            f"optim.decay_fraction at most {most:.3g} or fewer warmup steps"]


def check_head_dim(c: Config) -> list[str]:
    m = c.model
    derived = m.head_dim == m.dim // m.n_heads
    if m.head_dim % 2 == 0 or (derived and m.dim % m.n_heads):
        return []
    if derived:
        return [f"model.dim={m.dim} / model.n_heads={m.n_heads} = {m.head_dim} is an odd head "
                "dimension; RoPE rotates pairs: choose dim and n_heads with an even quotient "
                "(or set an even model.head_dim)"]
    return [f"model.head_dim={m.head_dim} is odd; RoPE rotates pairs: choose an even one"]


def check_model_shape(c: Config) -> list[str]:
    m, tp, errs = c.model, c.parallel.tp, []
    if m.dim % m.n_heads and m.head_dim == m.dim // m.n_heads:
        errs.append(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}: "
                    "choose a divisor, or set model.head_dim (then wq maps dim to "
                    "n_heads × head_dim)")
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
    stages = c.parallel.pp  # virtual stages exist in interleaved_1f1b and zbv (2) only
    if c.parallel.schedule == "interleaved_1f1b":
        stages *= c.parallel.virtual_stages
    if c.parallel.schedule == "zbv":
        stages *= 2
    if m.n_layers % stages:
        errs.append(f"model.n_layers={m.n_layers} is not divisible by the {stages} pipeline "
                    f"stages of parallel.pp={c.parallel.pp}, parallel.schedule="
                    f"{c.parallel.schedule}, parallel.virtual_stages={c.parallel.virtual_stages}:"
                    f" choose pp and virtual_stages whose product divides the layer count")
    r = m.rope_scaling
    if r.type == "llama3" and r.high_freq_factor <= r.low_freq_factor:
        errs.append(f"model.rope_scaling.high_freq_factor={r.high_freq_factor:g} must exceed "
                    f"model.rope_scaling.low_freq_factor={r.low_freq_factor:g} (llama3 blends "
                    "the frequencies between them): e.g. 1.0 and 4.0, as Llama 3.1")
    if c.train.seq_len > m.max_seq_len:
        errs.append(f"train.seq_len={c.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}:"
                    f" lower train.seq_len or raise model.max_seq_len")
    if c.parallel.sp and c.train.seq_len % tp:
        errs.append(f"train.seq_len={c.train.seq_len} is not divisible by parallel.tp={tp}, "
                    "required by parallel.sp=true: choose a seq_len that is a multiple of tp "
                    "or set parallel.sp=false")
    return errs


def check_packing(c: Config) -> list[str]:
    if c.train.batching == "tokens" and c.data.packing != "documents":
        return [f"train.batching=tokens packs whole documents into padded rows, which needs "
                f"data.packing=documents, not data.packing={c.data.packing}: set "
                f"data.packing=documents or train.batching=rows"]
    return []


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


def check_eval(c: Config) -> list[str]:
    t = c.train
    if not t.eval_every:
        return []
    problem = eval_split_problem(t.eval_samples, dp=c.parallel.dp, micro_batch=t.micro_batch_size)
    return [problem] if problem else []


def check_device(c: Config) -> list[str]:
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


def check_attention(c: Config) -> list[str]:
    """The backend's device, dtype and direction limits (ops.attention.backend_problem)."""
    if c.cluster.launcher == "slurm" and "SLURM_PROCID" not in os.environ:
        return []  # submitting from a login node: checked again in each Slurm task
    problem = backend_problem(c.model.attention, device_type=resolve_device_type(
        c.cluster.device), training=reads_data(c), precision=c.train.precision)
    return [problem] if problem else []


def check_fp8(c: Config) -> list[str]:
    """FP8 linears scale bf16 activations and gradients into float8: they need bf16 autocast."""
    if c.train.fp8 and c.train.precision != "bf16":
        return [f"train.fp8=true runs the linears' GEMMs in float8 on top of bf16 autocast, but "
                f"train.precision={c.train.precision}: set train.precision=bf16, or "
                "train.fp8=false"]
    return []


def check_not_built(c: Config) -> list[str]:
    """Combinations refused by design (the message says why), never silently ignored."""
    p = c.parallel
    # Benchmarks other than bench=train only build the layout's process groups, never a model.
    groups_only = c.task == "bench" and (c.extra.get("bench") or {}).get("name") != "train"
    # ZeRO 0-2 compose with tp and pp, ZeRO-3 with tp (the engine works on local parameters,
    # so do offload and grad_comm_dtype); ZeRO-3 with pp is refused by design.
    if p.zero == 3 and p.pp > 1 and not groups_only:
        return [_ZERO3_PP.format(pp=p.pp, m=c.grad_accum, gathers=2 * c.grad_accum)]
    return []


# Refused by design, not for lack of time: see the message.
_ZERO3_PP = (
    "parallel.zero=3 with parallel.pp={pp} is refused: a pipeline runs each stage's blocks once "
    "per microbatch and action, so ZeRO-3 would all-gather the stage's parameters before every "
    "F and B action ({m} microbatches → {gathers} all-gathers of the whole stage per step, "
    "interleaved with the schedule's p2p and lengthening its critical path), against one "
    "all-gather per step for ZeRO-1/2; keeping them gathered for the step would save no memory "
    "over ZeRO-2. Pipeline parallelism already divides parameters by pp: use parallel.zero=1 "
    "or 2 with parallel.pp > 1 (or zero=3 with parallel.pp=1)")


def check_bench(c: Config) -> list[str]:
    return bench_problems(c)


def check_plan(c: Config) -> list[str]:
    """task=plan: the plan.* settings (keys, ranges, lists) and the cluster's accelerator."""
    errs = plan_setting_problems(c)
    try:
        plan_settings(c)
    except ValueError:  # unknown or mistyped plan.* keys: the accelerator is checked alone
        return errs + _errors_of(c, cluster_spec)
    return errs + _errors_of(c, plan_cluster)


def check_dryrun(c: Config) -> list[str]:
    """task=dryrun: the dryrun.* settings and its ranks inside the job's world."""
    return _errors_of(c, chosen_ranks)


def check_cluster_spec(c: Config) -> list[str]:
    """A run predicts its step time from cluster.accelerator or cluster.calibration (a
    bench.json): a name not in the table or a missing file is refused here, not in the ranks."""
    if c.cluster.accelerator is None and c.cluster.calibration is None:
        return []
    return _errors_of(c, cluster_spec)


def reads_data(c: Config) -> bool:
    """task=train, bench=train and task=prepare read the data (train: also checkpoints)."""
    if c.task == "bench":
        try:
            return needs_data(c.extra)
        except ValueError:  # a bad bench group: check_bench reports it
            return False
    return c.task in ("train", "prepare")


# Checks → the keys they read ("group." is every key of a group); the first is the key a
# problem is reported under. A check is skipped when a key it reads was already reported, so
# none divides by zero, builds a fix from a bad value or repeats a problem. INPUTS (one key
# each: the launcher, paths) run before DERIVED (cross-field) and can mute them.
INPUTS: dict[Check, tuple[str, ...]] = {
    check_local_nodes: ("cluster.nodes", "cluster.launcher"),
    check_resume: ("train.resume",),
    check_data_paths: ("data.paths", "data.source", "data.format", "data.val_paths",
                       "data.mixture"),
    check_format: ("data.format", "data.paths"),
    check_tokenizer: ("data.tokenizer", "data.tokenizer_path", "data.bos_token",
                      "data.eod_token"),
    check_cache_dir: ("data.cache_dir", "data."),
}
_BATCH = ("train.global_batch_size", "train.micro_batch_size", "parallel.")
_SHAPE = ("model.", "parallel.tp", "parallel.pp", "parallel.virtual_stages", "parallel.sp",
          "parallel.schedule", "train.seq_len")
DERIVED: dict[Check, tuple[str, ...]] = {
    check_cp: ("parallel.cp", "parallel.cp_comm", "train.seq_len", "parallel.", "model."),
    check_world: ("parallel.dp", "parallel.cp", "parallel.tp", "parallel.pp", "cluster.nodes",
                  "cluster.procs_per_node"),
    check_hsdp: ("parallel.dp_replicate", "parallel.dp", "parallel.dp_shard", "parallel.ep",
                 "cluster.procs_per_node"),
    check_signal_delay: ("cluster.signal_delay_s", "cluster.time_min", "cluster.launcher"),
    check_elastic: ("cluster.elastic", "cluster.min_nodes", "cluster.nodes",
                    "cluster.launcher"),
    check_optim: ("optim.min_lr", "optim.lr", "optim.lr_schedule"),
    check_lr_schedule: ("optim.lr_schedule", "optim.warmup_steps", "optim.decay_fraction",
                        "train.steps"),
    check_head_dim: ("model.dim", "model.n_heads", "model.head_dim"),
    check_model_shape: _SHAPE,
    check_batch: _BATCH,
    check_eval: ("train.eval_samples", "train.eval_every", *_BATCH),
    check_packing: ("train.batching", "data.packing"),
    check_vocab: ("model.vocab_size", "data."),
    check_model_tokenizer: ("data.tokenizer", "data.", "model.init_from"),
    check_data_size: ("data.", "train.", "parallel.dp"),
    check_device: ("cluster.", "train."),
    check_attention: ("model.attention", "cluster.", "train.precision"),
    check_fp8: ("train.fp8", "train.precision"),
    check_not_built: ("parallel.", "bench"),
    check_moe: ("model.moe.", "parallel.", "train.activation_checkpointing"),
    check_schedule: _BATCH,
    check_pipeline: (*_BATCH, *_SHAPE, "train.activation_checkpointing", "cluster."),
    check_cluster_spec: ("cluster.",),
    check_bench: ("bench", "cluster.", "parallel."),
    check_simulate: _BATCH,
    check_plan: ("plan", "cluster.", *_BATCH, *_SHAPE, "train."),
    check_dryrun: ("dryrun", "parallel.", "model.moe."),
    check_export: ("export",),
    check_export_every: ("train.export_every", "train.keep_every", "train.checkpoint_every",
                         "model."),
    check_generate: ("generate", "model.init_from", "model.max_seq_len"),
    check_eval_task: ("eval", "cluster.", "model.init_from"),
}
# What reads the token cache and checkpoints runs only where the task does (reads_data).
DATA_CHECKS = (check_resume, check_data_paths, check_format, check_tokenizer, check_cache_dir,
               check_vocab, check_model_tokenizer, check_data_size)
CHECKS: tuple[Check, ...] = (*INPUTS, check_cp, check_world, check_hsdp, check_signal_delay,
                             check_elastic,
                             check_optim, check_lr_schedule, check_head_dim, check_model_shape,
                             check_batch, check_eval, check_packing,
                             check_vocab, check_model_tokenizer, check_data_size,
                             check_device, check_attention, check_export_every,
                             check_fp8, check_not_built, check_moe, check_schedule, check_pipeline,
                             check_cluster_spec, check_bench)
TASK_CHECKS: dict[str, tuple[Check, ...]] = {
    "train": CHECKS,
    "bench": CHECKS,
    # task=simulate runs no ranks, trains nothing: only the schedule and its costs matter.
    "simulate": (check_simulate,),
    # The planner predicts any layout, including ones this version cannot run yet.
    "plan": (check_cp, check_world, check_head_dim, check_model_shape, check_batch, check_schedule,
             check_plan),
    # task=prepare tokenises the data once, no ranks: only what it reads and writes matters.
    "prepare": (check_data_paths, check_format, check_tokenizer, check_cache_dir),
    # task=export reads one checkpoint, no ranks, no data: its model comes from the checkpoint.
    "export": (check_export,),
    # task=generate samples from one model on one device: its model and prompts matter.
    "generate": (check_generate,),
    # task=eval: one process; its data and model come from the run (or eval.*, data.*).
    "eval": (check_eval_task,),
    # task=compat validates its own cells (hpctrain.compat), whatever else is configured.
    "compat": (),
    # task=dryrun sets up ranks of the job on meta tensors here: everything a training run
    # checks but the data and this machine's devices (the job's are elsewhere).
    "dryrun": (*(c for c in CHECKS if c not in (check_device, check_attention)), check_dryrun),
}


def problems_of(c: Config, *, found: Sequence[Problem] = ()) -> list[Problem]:
    """Every problem of `c`: `found` (from building it), choices and ranges, then INPUTS,
    then DERIVED, each check skipped if a key it reads was already reported."""
    problems = [*found, *choice_problems(c), *config_range_problems(c)]
    if "task" in {p.key for p in problems}:
        return problems
    data = reads_data(c)
    wanted = [k for k in TASK_CHECKS[c.task] if data or k not in DATA_CHECKS]
    for stage in (INPUTS, DERIVED):
        failed = {p.key for p in problems}
        problems += [Problem(reads[0], text) for check, reads in stage.items()
                     if check in wanted and not _reads_any(reads, failed) for text in check(c)]
    return problems


def _reads_any(reads: tuple[str, ...], failed: set[str]) -> bool:
    return any(key == r or key.startswith(r if r.endswith(".") else r + ".")
               for r in reads for key in failed)


def validate(c: Config, *, found: Sequence[Problem] = ()) -> None:
    """Raise one ValueError listing every problem of `c` (and `found`), each once."""
    problems = problems_of(c, found=found)
    if problems:
        raise ValueError(format_problems(problems))

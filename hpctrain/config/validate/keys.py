"""Key-level rules, as tables: the allowed values of every choice key (`choices`: the
dataclasses' `Literal` annotations plus REGISTRY_CHOICES) and the range of every numeric key
(`RANGES`: key → Range, with the fix for a value outside it).

A value outside its range becomes "<key>=<value> must be <range>: <fix>". Each problem carries
its key, so `hpctrain.config.validate` can skip the cross-field checks that read a key already found
bad (they would divide by zero or suggest a wrong fix). None passes for keys whose type allows
it (it means "unset"); the type itself is checked by `config.build_checked`. The task groups
read from `Config.extra` check their own ranges: bench (hpctrain.config.bench), simulate
(sim_task.simulate_costs), plan (PLAN_RANGES below, applied by validate.check_plan).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields
from typing import Any

from hpctrain.config.build import Problem, choice_text, literal_choices, type_hints
from hpctrain.config.schema import RUN_GROUPS, Config, Task
from hpctrain.ops.attention import ATTENTION_BACKENDS
from hpctrain.parallel.pipeline.schedules import SCHEDULES

TASKS: tuple[str, ...] = typing.get_args(Task)


def literal_table() -> dict[str, tuple]:
    """key → allowed values of every `Literal[...]` field of the run's groups, read from the
    dataclass annotations (the one list; `config.build_checked` enforces it while parsing)."""
    table = {"task": TASKS}
    for group, cls in RUN_GROUPS.items():
        hints = type_hints(cls)
        table.update({f"{group}.{f.name}": allowed for f in fields(cls)
                      if (allowed := literal_choices(hints[f.name])) is not None})
    return table


# Choices that live in a registry, not a Literal: a new attention kernel or pipeline schedule
# registers itself, and these keys accept what is registered. Checked here, after parsing.
REGISTRY_CHOICES = ("model.attention", "parallel.schedule")


def choices(c: Config) -> dict[str, tuple[object, tuple]]:
    """key → (value, allowed values) of every key with a fixed set of values: the Literal
    fields (already enforced by parsing) and the registry-backed REGISTRY_CHOICES."""
    registry = {"model.attention": tuple(ATTENTION_BACKENDS),
                "parallel.schedule": tuple(SCHEDULES)}
    table = {**literal_table(), **registry}
    return {key: (key_value(c, key), allowed) for key, allowed in table.items()}


def choice_problems(c: Config) -> list[Problem]:
    return [Problem(key, choice_text(key, value, allowed))
            for key, (value, allowed) in choices(c).items() if value not in allowed]


@dataclass(frozen=True)
class Range:
    """lo ≤ value ≤ hi (strict where lo_open / hi_open); a bound of None is no bound."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    fix: str | None = None  # what to do instead; default: "set it to <a value inside>"

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '≥'} {_num(self.lo)}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '≤'} {_num(self.hi)}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}"

    def advice(self) -> str:
        if self.fix:
            return self.fix
        if self.hi is None:
            return "set it to 1 or more" if self.lo_open and self.lo == 0 else \
                f"set it to {_num(self.lo)} or more"
        return f"set it between {_num(self.lo)} and {_num(self.hi)}"


def _num(x: float | None) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def at_least(lo: float, fix: str | None = None) -> Range:
    return Range(lo=lo, fix=fix)


def positive(fix: str | None = None) -> Range:
    return Range(lo=0, lo_open=True, fix=fix)


def fraction(*, lo_open: bool = False, hi_open: bool = False, fix: str | None = None) -> Range:
    return Range(lo=0, hi=1, lo_open=lo_open, hi_open=hi_open, fix=fix)


_COUNT = "set it to 1 or more"
MAX_TIMEOUT_S = 7 * 24 * 3600
RANGES: dict[str, Range] = {
    "cluster.nodes": positive(),
    "cluster.procs_per_node": positive("one rank per GPU (or CPU process): e.g. "
                                       "cluster.procs_per_node=1"),
    # torch turns the timeout into int64 nanoseconds (~292 years: beyond it, an immediate false
    # hang); a week is far past any collective or checkpoint load and far inside that
    "cluster.timeout_s": Range(lo=0, hi=MAX_TIMEOUT_S, lo_open=True,
                               fix="a stuck collective fails after this many seconds: e.g. "
                                   "cluster.timeout_s=300 (at most a week)"),
    "cluster.threads_per_proc": positive(),
    "cluster.max_restarts": at_least(0, "how many faults a job requeues itself after: e.g. "
                                        "cluster.max_restarts=3 (0: none)"),
    "cluster.straggler_window": at_least(0, "steps between straggler checks: e.g. "
                                            "cluster.straggler_window=50 (0: never)"),
    "cluster.straggler_threshold": positive("a fraction over the median compute time: e.g. "
                                            "cluster.straggler_threshold=0.2"),
    "cluster.min_nodes": positive("the fewest nodes an elastic job runs on: e.g. "
                                  "cluster.min_nodes=1"),
    "cluster.time_min": positive("the Slurm time limit in minutes: e.g. cluster.time_min=60"),
    "cluster.gpus_per_node": at_least(0, "set it to 0 (no --gres) or the GPUs of a node"),
    "cluster.cpus_per_task": positive(),
    "cluster.mem_gb": at_least(0, "set it to 0 (all of a node's memory) or null (default)"),
    "cluster.signal_delay_s": at_least(0, "seconds before the time limit to checkpoint: "
                                          "e.g. cluster.signal_delay_s=120"),
    "cluster.intra_node_gb_s": positive("give the per-GPU link bandwidth, e.g. 300.0"),
    "cluster.inter_node_gb_s": positive("give the per-node network bandwidth, e.g. 200.0"),
    "cluster.achievable_fraction": fraction(lo_open=True, fix="e.g. 0.5 of the dense peak"),
    "parallel.dp": positive(),
    "parallel.tp": positive(),
    "parallel.pp": positive(),
    "parallel.cp": positive(),
    "parallel.ep": positive(),
    "parallel.dp_replicate": positive("1: no hybrid sharding; e.g. the number of nodes"),
    "parallel.dp_shard": positive("or leave it unset (null): dp / dp_replicate"),
    "parallel.zero": Range(lo=0, hi=3, fix="ZeRO stages are 0 (plain data parallel), 1, 2, 3"),
    "parallel.microbatches": positive("or leave it unset (null) to derive it from the batch"),
    "parallel.virtual_stages": positive(),
    "parallel.bucket_mb": positive("e.g. parallel.bucket_mb=25"),
    "train.steps": positive(),
    "train.seed": Range(lo=0, hi=2**32 - 1),
    "train.global_batch_size": positive(),
    "train.micro_batch_size": positive(),
    "train.seq_len": Range(lo=2, fix="a sample needs at least 2 tokens: e.g. train.seq_len=128"),
    "train.grad_clip": at_least(0, "set it to 0 (no clipping) or a positive norm, e.g. 1.0"),
    "train.log_every": positive(),
    "train.eval_every": at_least(0, "set it to 0 (no evaluation) or a step interval"),
    "train.eval_samples": positive(f"{_COUNT}, or train.eval_every=0 to skip eval"),
    "train.checkpoint_every": at_least(0, "set it to 0 (save at the end only) or a step "
                                          "interval"),
    "train.keep": at_least(0, "the newest verified checkpoints to keep (0: all), e.g. 2"),
    "train.keep_every": at_least(0, "set it to 0 (none) or a step interval whose "
                                    "checkpoints are kept for good, e.g. 1000"),
    "train.export_every": at_least(0, "set it to 0 (none) or a multiple of train.keep_every, "
                                      "e.g. 1000"),
    "train.profile_steps": positive(f"{_COUNT} (steps traced with train.profile=true)"),
    "train.stop_after": positive(f"{_COUNT}, or null to run all train.steps"),
    "optim.lr": positive("e.g. optim.lr=3e-3"),
    "optim.min_lr": at_least(0, "set it to 0 or a fraction of optim.lr, e.g. lr/10"),
    "optim.weight_decay": at_least(0, "set it to 0 (none) or e.g. 0.1"),
    "optim.beta1": fraction(hi_open=True, fix="e.g. optim.beta1=0.9"),
    "optim.beta2": fraction(hi_open=True, fix="e.g. optim.beta2=0.95"),
    "optim.eps": positive("e.g. optim.eps=1e-8"),
    "optim.warmup_steps": at_least(0, "set it to 0 (no warmup) or a step count"),
    "optim.decay_fraction": fraction(lo_open=True, fix="the share of train.steps that wsd "
                                                       "decays over: e.g. 0.2"),
    "data.bpe_vocab_size": at_least(257, "the byte-level alphabet (256) plus end-of-document "
                                         "need 257: e.g. data.bpe_vocab_size=512"),
    "data.max_bytes": positive("e.g. data.max_bytes=4000000"),
    "data.workers": positive("prepare's tokenizer processes: e.g. data.workers=4"),
    "data.shard_bytes": positive("input bytes per shard: e.g. data.shard_bytes=64000000"),
    "data.val_fraction": fraction(lo_open=True, hi_open=True,
                                  fix="both splits need tokens: e.g. data.val_fraction=0.01"),
    "model.vocab_size": positive(),
    "model.dim": positive(),
    "model.n_layers": positive(),
    "model.n_heads": positive(),
    "model.n_kv_heads": positive(),
    "model.ffn_dim": positive(),
    "model.head_dim": at_least(0, "set it to 0 (model.dim / model.n_heads) or an even width "
                                  "per head, e.g. 128"),
    "model.max_seq_len": Range(lo=2, fix="e.g. model.max_seq_len=256"),
    "model.rope_theta": positive("e.g. model.rope_theta=10000"),
    "model.norm_eps": positive("e.g. model.norm_eps=1e-5"),
    "model.moe.num_experts": at_least(0, "set it to 0 (a dense model) or the routed expert "
                                         "count, e.g. 8"),
    "model.moe.top_k": positive("the experts each token goes to: e.g. model.moe.top_k=2"),
    "model.moe.every": positive("1 makes every block an MoE block, 2 every second one"),
    "model.moe.shared_experts": at_least(0, "set it to 0 (none) or e.g. 1"),
    "model.moe.expert_ffn_dim": at_least(0, "set it to 0 (the model's ffn_dim) or an expert's "
                                            "hidden size, e.g. 1408"),
    "model.moe.aux_loss_coef": at_least(0, "set it to 0 (no load-balancing loss) or e.g. 0.01"),
    "model.moe.z_loss_coef": at_least(0, "set it to 0 (no router z-loss) or e.g. 0.001"),
    "model.moe.capacity_factor": at_least(0, "set it to 0 (dropless) or e.g. 1.25"),
    "model.rope_scaling.factor": at_least(1, "the context extension factor: e.g. 8.0"),
    "model.rope_scaling.low_freq_factor": positive("e.g. model.rope_scaling.low_freq_factor=1.0"),
    "model.rope_scaling.high_freq_factor": positive("e.g. model.rope_scaling.high_freq_factor="
                                                    "4.0"),
    "model.rope_scaling.original_max_seq_len": positive("the pre-training context length: e.g. "
                                                        "8192"),
}


def check_range(key: str, value: Any, rule: Range) -> list[Problem]:
    """The problem of one value (none for None: unset), numbers only."""
    if value is None:
        return []
    if isinstance(value, bool) or not isinstance(value, int | float):
        return [Problem(key, f"{key}={value!r} should be a number: {rule.advice()}")]
    if rule.holds(value):
        return []
    finite = "" if math.isfinite(value) else "a finite number "
    return [Problem(key, f"{key}={value} must be {finite}{rule.describe()}: {rule.advice()}")]


def range_problems(values: dict[str, Any], table: dict[str, Range]) -> list[Problem]:
    """Every value of `values` (key → value) outside its range in `table`."""
    return [p for key, rule in table.items() if key in values
            for p in check_range(key, values[key], rule)]


def config_range_problems(c: Config) -> list[Problem]:
    """Every key of `RANGES` whose value in `c` is outside its range."""
    return range_problems({key: key_value(c, key) for key in RANGES}, RANGES)


def key_value(c: Config, key: str) -> Any:
    """The value of a dotted key (`model.moe.top_k`) of `c`."""
    value: Any = c
    for name in key.split("."):
        value = getattr(value, name)
    return value


def key_problems(c: Config) -> list[Problem]:
    """The key-level problems of `c`: every choice and every range."""
    return [*choice_problems(c), *config_range_problems(c)]

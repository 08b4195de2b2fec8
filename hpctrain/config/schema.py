"""The typed run configuration: frozen dataclasses built from Hydra's composed config.

The schema every layer reads, so it imports nothing above `hpctrain.models`. `collect` converts
every group into its dataclass and rejects unknown keys (with a "did you mean");
`hpctrain.tasks.configure.parse` (at the Hydra entry points) adds the cross-field checks of
`hpctrain.config.validate`, so every mistake a user can make fails before any rank process starts.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from hpctrain.config.build import Problem, build_checked, format_problems, no_default
from hpctrain.distributed.dims import ParallelDims
from hpctrain.models.config import ModelConfig
from hpctrain.models.llama.hf_config import resolve_init_from, with_model_tokenizer


@dataclass(frozen=True)
class ClusterConfig:
    name: str = "local"
    launcher: Literal["local", "slurm"] = "local"
    nodes: int = 1
    procs_per_node: int = 1  # rank processes per node (GPUs per node on a GPU cluster)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    timeout_s: int = 300  # process-group timeout: a mismatched collective fails, never hangs
    threads_per_proc: int = 1
    # Slurm settings (used when launcher=slurm).
    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    qos: str | None = None
    time_min: int = 60  # --time; submitit sends USR2 signal_delay_s before it
    constraint: str | None = None
    exclude: str | None = None
    # Faults on Slurm (hpctrain.launch.requeue): a dead node or a hung rank requeues the job
    # without the node(s) named, at most this many times (preemptions and time limits do not
    # count). elastic: the job asks for --nodes=min_nodes-nodes and each start runs the world
    # Slurm gave it, at a layout chosen for it (hpctrain.launch.elastic).
    max_restarts: int = 3
    elastic: bool = False
    min_nodes: int = 1
    # Stragglers (hpctrain.distributed.stragglers): every straggler_window steps (0: never) a
    # rank whose compute time exceeds the median by more than straggler_threshold (a fraction)
    # is named; exclude_stragglers: its node is excluded at the next restart.
    straggler_window: int = 50
    straggler_threshold: float = 0.2
    exclude_stragglers: bool = False
    # Before submitting a training job: set up its chosen ranks on meta tensors (task=dryrun,
    # hpctrain.tasks.dryrun.run) and submit only when every one fits the usable memory.
    check_before_submit: bool = False
    gpus_per_node: int = 0  # > 0 adds --gres=gpu:N
    cpus_per_task: int = 1
    mem_gb: int | None = None  # 0: all of a node's memory (--mem=0)
    setup: tuple[str, ...] = ()  # shell lines run in the job script before srun (module load)
    signal_delay_s: int = 120  # Slurm: USR2 this long before the limit; local: stop grace
    env: dict[str, str] = field(default_factory=dict)  # exported in the job: NCCL_IB_HCA, ...
    # What the planner (task=plan) assumes about the hardware; GPUs per node = procs_per_node.
    accelerator: str | None = None  # a row of hpctrain.metrics.devices, e.g. H100-SXM, H200
    intra_node_gb_s: float = 300.0  # per GPU, one direction (NVLink)
    inter_node_gb_s: float = 200.0  # per node, one direction (all NICs)
    # Share of the dense peak a step's GEMMs reach (plan.kernels); None: the accelerator's
    # generation row of hpctrain.plan.hardware (A100 0.7, H100/H200 0.5), 0.7 elsewhere.
    achievable_fraction: float | None = None
    # A task=bench bench.json (or its run dir): measured GEMM peak and link bandwidths replace
    # the table's and the *_gb_s values above (hpctrain.plan.calibrate).
    calibration: str | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks (zigzag, ring attention)
    cp_comm: Literal["ring", "allgather"] = "ring"  # how key/value shards travel under cp > 1
    ep: int = 1  # expert parallelism: routed experts sharded over ep ranks inside the dp group
    # HSDP: dp = dp_replicate × dp_shard; ZeRO shards inside dp_shard (one node), the replicas
    # all-reduce (hpctrain.distributed.dims). dp_shard None: dp / dp_replicate.
    dp_replicate: int = 1
    dp_shard: int | None = None
    zero: int = 0  # 0 (plain data parallel) | 1 | 2 | 3
    sp: bool = False  # sequence parallelism (with tp > 1)
    offload: Literal["none", "cpu"] = "none"
    schedule: str = "1f1b"  # a name of the schedule registry (validate_keys.REGISTRY_CHOICES)
    microbatches: int | None = None  # None: global_batch / (micro_batch × dp)
    virtual_stages: int = 1  # chunks per rank: ≥ 2 for interleaved_1f1b (zbv always runs 2)
    bucket_mb: float = 25.0
    grad_comm_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # on the wire; fp32 accumulation
    timeline: bool = False  # pp > 1: write the last step's measured timeline (JSON + PNG)
    # parallel=auto: the planner chooses every degree, the schedule, ZeRO and activation
    # checkpointing at launch (hpctrain.plan.auto); the values above are replaced, except the
    # keys named in `fixed`, which the search keeps as given ("key" or "key=value"; parse adds
    # every parallel.<key> or train.activation_checkpointing given with parallel=auto and
    # records each value as given, e.g. "parallel.pp=1").
    auto: bool = False
    fixed: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dims(self) -> ParallelDims:
        """The layout (degrees and rank order) every consumer derives from; raises ValueError
        for degrees that do not compose."""
        return ParallelDims(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                            dp_replicate=self.dp_replicate)


# The keys parallel=auto may be told to keep (`parallel.fixed`: "key" or "key=value").
FIXABLE = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep",
           "parallel.zero", "parallel.schedule", "parallel.virtual_stages", "parallel.sp",
           "parallel.offload", "parallel.cp_comm", "parallel.dp_replicate",
           "train.activation_checkpointing")


def fixed_values(cfg: Config) -> dict[str, Any]:
    """key → value of every `key=value` of parallel.fixed (parse records the values as given,
    before the search replaces the layout: the config holds the winner's afterwards)."""
    out = {}
    for entry in cfg.parallel.fixed:
        key, _, text = entry.partition("=")
        group, name = key.split(".")
        out[key] = fixed_value(getattr(getattr(cfg, group), name), text)
    return out


def fixed_value(like: Any, text: str) -> Any:
    """`text` as a value of the type of `like` (int, bool or str); ValueError otherwise."""
    if isinstance(like, bool):
        if text not in ("true", "false"):
            raise ValueError(text)
        return text == "true"
    return int(text) if isinstance(like, int) else text


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    seed: int = 1234
    global_batch_size: int = 16
    micro_batch_size: int = 4
    seq_len: int = 128
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # fp16 on CPU: allow_slow_precision
    allow_slow_precision: bool = False
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    # parallel.zero=3: free each block's gathered weights after its forward and gather them
    # again for its backward (FSDP2's default); false holds them until the block's backward
    # (one gather a micro-batch, every block of the rank held at the end of the forward)
    zero3_reshard_after_forward: bool = True
    # torch.compile: each transformer block on its own (one graph shared by identical blocks),
    # or the whole forward (hpctrain.models.compile). Compile time is in summary.json.
    compile: Literal["none", "blocks", "model"] = "none"
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 50
    # validation samples evaluated, the same for every layout: split over the dp ranks in
    # micro-batches, so a multiple of parallel.dp × micro_batch_size (hpctrain.train.eval_set)
    eval_samples: int = 16
    checkpoint_every: int = 100  # every N steps (and at the end); 0: only at the end
    # Saves write each rank's own shards (hpctrain.checkpoint.writer); async: staged to host
    # memory and written in the background while training continues (false: the step waits).
    checkpoint_async: bool = True
    keep: int = 2  # newest verified checkpoints kept (0: all)
    keep_every: int = 0  # every checkpoint at a multiple of this step is kept for good (0: none)
    # each kept checkpoint at a multiple of this step also as a Hugging Face directory,
    # <run_dir>/hf/step_XXXXXXXX, written while training goes on (0: none; hpctrain.train.exports)
    export_every: int = 0
    resume: str = "auto"  # auto (newest verified checkpoint of the run dir) | never | <dir>
    # A resume whose data.*/train.seed/seq_len differ from the checkpoint's would read other
    # tokens or another order: refused unless allow (hpctrain.checkpoint.resume_changes)
    resume_changes: Literal["refuse", "allow"] = "refuse"
    profile: bool = False  # torch.profiler Chrome trace of a few steps
    profile_steps: int = 3
    stop_after: int | None = None  # stop (with a checkpoint) after this step, as a preemption would
    # A NaN/inf loss or grad norm: stop (exit 3), skip the update, or roll back to the last
    # verified checkpoint and skip that data (hpctrain.train.nonfinite).
    on_nonfinite: Literal["stop", "skip", "rollback"] = "stop"
    # rows: windows cut from the token stream; tokens: whole documents grouped by length, little
    # padding (hpctrain.data.packing). Budget per micro-batch: micro_batch_size × seq_len tokens.
    batching: Literal["rows", "tokens"] = "rows"
    # FP8 linears (hpctrain.ops.fp8): their three GEMMs in float8 with dynamic scales, on top
    # of precision=bf16; master weights and optimizer state stay fp32. fp8_skip: module names
    # (fnmatch patterns, matched against the name and its tail) that stay in bf16.
    fp8: bool = False
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    fp8_skip: tuple[str, ...] = ("tok_embeddings", "output")


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    # After the linear warmup (formulas: hpctrain.train.optim): cosine or linear decay to
    # min_lr, constant, inv_sqrt (lr·sqrt(warmup/step)) or wsd (warmup-stable-decay: lr until
    # the last decay_fraction of train.steps, then decay_shape down to min_lr).
    lr_schedule: Literal["cosine", "linear", "wsd", "inv_sqrt", "constant"] = "cosine"
    decay_fraction: float = 0.2  # wsd only
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"  # wsd only


@dataclass(frozen=True)
class Corpus:
    """One corpus of data.mixture: its files (read like data.paths, in its own format and text
    key when given), its weight and its name (metrics `loss_<name>`, ...; empty: corpus<i>)."""

    paths: tuple[str, ...]
    weight: float
    name: str = ""
    format: Literal["text", "jsonl", "parquet", "hf"] | None = None  # null: data.format
    text_key: str | None = None  # null: data.text_key


def corpus_name(corpus: Corpus, index: int) -> str:
    return corpus.name or f"corpus{index}"


def corpus_view(data: DataConfig, corpus: Corpus) -> DataConfig:
    """`data` as one corpus of its mixture is read: its paths, format and text key."""
    return dataclasses.replace(data, paths=corpus.paths, mixture=(), stages=(), val_paths=(),
                               format=corpus.format or data.format,
                               text_key=corpus.text_key or data.text_key)


@dataclass(frozen=True)
class Stage:
    """One stage of data.stages: from the previous stage's until_step (0 for the first), the
    corpora's weights by name (a corpus left out has weight 0); the last stage holds to the
    end of the run."""

    until_step: int
    mixture: dict[str, float]


@dataclass(frozen=True)
class DataConfig:
    name: str = "stdlib"
    # stdlib: this Python's standard-library sources (capped at max_bytes); files: data.paths
    # (files, globs or directories of shards, read as data.format); tokens: a prepared directory.
    source: Literal["stdlib", "files", "tokens"] = "stdlib"
    paths: tuple[str, ...] = ()
    # Weighted corpora instead of data.paths: [{name: web, paths: [...], weight: 0.7}, ...];
    # corpus i gives weight_i / Σ weights of the samples of every step, drawn by a seeded
    # schedule (hpctrain.data.schedule); each is its own epochs, loss, tokens and eval loss.
    mixture: tuple[Corpus, ...] = ()
    # Other weights over the run, e.g. annealing on the best corpus for the last 10%:
    # [{until_step: 900, mixture: {web: 0.7, math: 0.3}}, {until_step: 1000, mixture: {math: 1}}]
    # (hpctrain.data.schedule); empty: data.mixture's weights throughout.
    stages: tuple[Stage, ...] = ()
    # The val split from its own files (read like paths); empty: the last val_fraction of the
    # token stream.
    val_paths: tuple[str, ...] = ()
    # text: a file is one document; jsonl: one JSON object per line (plain, .gz, .zst), its
    # text_key field; parquet: the text_key column; hf: a datasets.save_to_disk directory.
    format: Literal["text", "jsonl", "parquet", "hf"] = "text"
    text_key: str = "text"
    on_bad_record: Literal["error", "skip"] = "error"  # skip: skip and count bad records
    # byte: UTF-8 bytes; bpe: trained locally; hf: a tokenizer.json (tokenizer_path: the file
    # or its directory); tiktoken: a <encoding>.tiktoken file (tokenizer_path). null: the kind
    # of tokenizer_path (tiktoken for a .tiktoken file, else hf), else model.init_from's
    # tokenizer.json (hf), else byte (`tokenizer_kind`).
    tokenizer: Literal["byte", "bpe", "hf", "tiktoken"] | None = None
    tokenizer_path: str | None = None
    bos_token: str | None = None  # before each document; null: the tokenizer's own, '': none
    eod_token: str | None = None  # after each document; null: the tokenizer's end-of-text
    bpe_vocab_size: int = 512
    max_bytes: int = 4_000_000  # caps source=stdlib only
    val_fraction: float = 0.01
    workers: int = 1  # tokenizer processes of prepare (the output does not depend on it)
    shard_bytes: int = 64_000_000  # input bytes per shard (prepare's unit of work and resume)
    cache_dir: str = "~/.cache/hpctrain"
    # documents: attention and RoPE positions stay inside each document; none: a row is one text
    packing: Literal["documents", "none"] = "documents"

    def __post_init__(self) -> None:
        if self.tokenizer is None:  # collect() already took model.init_from's when it has one
            object.__setattr__(self, "tokenizer", tokenizer_kind(self.tokenizer_path))


def tokenizer_kind(path: str | None) -> str:
    """data.tokenizer left unset: what `path` holds (a .tiktoken file: tiktoken; another
    file or a directory: a Hugging Face tokenizer.json), byte without one."""
    if not path:
        return "byte"
    return "tiktoken" if str(path).endswith(".tiktoken") else "hf"


@dataclass(frozen=True)
class LoggerConfig:
    # auto: online with an API key, else offline. W&B runs on the logging rank only.
    wandb: Literal["auto", "online", "offline", "disabled"] = "auto"
    project: str = "hpctrain"
    entity: str | None = None
    group: str | None = None
    run_name: str | None = None
    progress: Literal["auto", "rich", "plain"] = "auto"  # auto: a rich bar on a terminal
    plot: bool = True  # training.png at the end of a run (about 0.3 s of matplotlib on 1 core)
    # Names (environment or cluster.env) whose values are masked wherever they appear, beside
    # those that look like credentials (…KEY, …TOKEN, …PASSWD, …AUTH, …: metrics.redact).
    redact: tuple[str, ...] = ()


Task = Literal["train", "simulate", "bench", "plan", "prepare", "export", "generate",
               "eval", "compat", "dryrun"]


@dataclass(frozen=True)
class TaskConfig:
    """The `task` group: what `python -m hpctrain` does (task=plan, simulate, prepare, export
    generate and eval run once, with no ranks; train and bench run on every rank)."""

    name: Task = "train"


@dataclass(frozen=True)
class Config:
    task: Task
    run_dir: str
    cluster: ClusterConfig
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    optim: OptimConfig
    data: DataConfig
    logger: LoggerConfig
    extra: dict[str, Any] = field(default_factory=dict)  # task-specific groups (simulate, plan...)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    @property
    def layout_label(self) -> str:
        """The run's layout in one line, e.g. "dp2 tp2 pp1 cp1 ep1 z1 1f1b accum4" (restart
        records, elastic starts)."""
        p = self.parallel
        return (f"dp{p.dp} tp{p.tp} pp{p.pp} cp{p.cp} ep{p.ep} z{p.zero}"
                + (f" hsdp{p.dp_replicate}" if p.dp_replicate > 1 else "")
                + f" {p.schedule} accum{self.grad_accum}")


# The run's groups (task groups: hpctrain.config.<name>, in Config.extra).
RUN_GROUPS = {
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "logger": LoggerConfig,
    "model": ModelConfig,
}


# Task groups (Config.extra), each read and checked by its own task; anything else is a typo.
TASK_GROUPS = ("bench", "simulate", "plan", "export", "generate", "eval", "dryrun")


def collect(raw: dict[str, Any], *, run_dir: str) -> tuple[Config | None, list[Problem]]:
    """Build a Config from a plain (resolved) dict and list the key-level problems: unknown
    top-level groups and unknown, missing or mistyped keys. None when no Config can be built."""
    raw = dict(raw)
    raw.pop("hydra", None)
    task = raw.pop("task", {"name": "train"})
    task_name = task.get("name", "train") if isinstance(task, dict) else str(task)
    model, hf_problems = _model_group(raw.pop("model", {}) or {})
    if isinstance(model, dict):  # model.init_from's tokenizer.json is the data's by default
        raw["data"] = with_model_tokenizer(raw.get("data"), model.get("init_from"))
    built = {name: build_checked(cls, name, model if name == "model" else raw.pop(name, {}) or {})
             for name, cls in RUN_GROUPS.items()}
    problems = [p for _, found in built.values() for p in found] + _unknown_groups(raw)
    problems += [Problem("model.init_from", text) for text in hf_problems]
    groups = {name: obj for name, (obj, _) in built.items()}
    if any(obj is None for obj in groups.values()):
        return None, problems
    return Config(task=task_name, run_dir=run_dir, extra=raw, **groups), problems


def _model_group(raw: Any) -> tuple[Any, list[str]]:
    """The model group, its shape taken from `model.init_from`'s config.json when set
    (hpctrain.models.llama.hf_config.resolve_init_from), and the problems found there."""
    if not isinstance(raw, dict):
        return raw, []
    defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING
                else dataclasses.asdict(f.default_factory())
                for f in fields(ModelConfig) if not no_default(f)}
    return resolve_init_from(raw, defaults=defaults)


def _unknown_groups(raw: dict[str, Any]) -> list[Problem]:
    known = [*RUN_GROUPS, "task", *TASK_GROUPS]
    problems = []
    for name in (n for n in raw if n not in TASK_GROUPS):
        value = raw[name]
        sub = f".{next(iter(value))}" if isinstance(value, dict) and value else ""
        close = difflib.get_close_matches(name, known, n=1)
        fix = f"did you mean {close[0]}{sub}?" if close else f"remove +{name}{sub}"
        problems.append(Problem(name, f"unknown top-level group {name}: nothing reads "
                                      f"{name}{sub}; {fix} (groups: {', '.join(known)})"))
    return problems


def from_dict(raw: dict[str, Any], *, run_dir: str) -> Config:
    """`collect`, raising one ValueError if any key is unknown, missing or mistyped."""
    config, problems = collect(raw, run_dir=run_dir)
    if problems:
        raise ValueError(format_problems(problems))
    return config

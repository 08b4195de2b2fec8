"""The typed run configuration: frozen dataclasses built from Hydra's composed config.

`parse(cfg)` is called right after the entry point. It converts every group into its dataclass,
rejects unknown keys (with a "did you mean"), and runs the cross-field checks in
`hpctrain.validate`, so every mistake a user can make fails before any rank process starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from hpctrain.models.config import ModelConfig


@dataclass(frozen=True)
class ClusterConfig:
    name: str = "local"
    launcher: str = "local"  # local | slurm
    nodes: int = 1
    procs_per_node: int = 1
    device: str = "auto"  # auto | cpu | cuda
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: int = 300  # process-group timeout: a mismatched collective fails, never hangs
    threads_per_proc: int = 1
    # Slurm settings (used when launcher=slurm).
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60
    constraint: str | None = None
    exclude: str | None = None
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: int | None = None
    setup: tuple[str, ...] = ()
    signal_delay_s: int = 120
    env: dict[str, str] = field(default_factory=dict)
    # What the planner (task=plan) assumes about the hardware; GPUs per node = procs_per_node.
    accelerator: str | None = None  # a row of hpctrain.plan.devices, e.g. H100-SXM
    intra_node_gb_s: float = 300.0  # per GPU, one direction (NVLink)
    inter_node_gb_s: float = 200.0  # per node, one direction (all NICs)
    achievable_fraction: float = 0.5
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
    zero: int = 0
    sp: bool = False
    offload: str = "none"  # none | cpu
    schedule: str = "1f1b"
    microbatches: int | None = None  # None: global_batch / (micro_batch × dp)
    virtual_stages: int = 1
    bucket_mb: float = 25.0
    grad_comm_dtype: str = "fp32"  # fp32 | bf16 | fp16 (on the wire; fp32 accumulation)
    timeline: bool = False  # pp > 1: write the last step's measured timeline (JSON + PNG)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    seed: int = 1234
    global_batch_size: int = 16
    micro_batch_size: int = 8
    seq_len: int = 128
    precision: str = "fp32"  # fp32 | bf16 | fp16
    allow_slow_precision: bool = False
    activation_checkpointing: str = "none"  # none | selective | full
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0: only at the end
    resume: str = "auto"  # auto | never | <checkpoint dir>
    profile: bool = False
    profile_steps: int = 3
    stop_after: int | None = None  # stop (with a checkpoint) after this step, as a preemption would
    on_nonfinite: str = "stop"  # stop | skip | rollback on a NaN/inf loss or grad norm


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    lr_schedule: str = "cosine"  # cosine | constant


@dataclass(frozen=True)
class DataConfig:
    name: str = "stdlib"
    source: str = "stdlib"  # stdlib | files | tokens
    paths: tuple[str, ...] = ()
    tokenizer: str = "byte"  # byte | bpe
    bpe_vocab_size: int = 512
    max_bytes: int = 4_000_000
    val_fraction: float = 0.01
    cache_dir: str = "~/.cache/hpctrain"


@dataclass(frozen=True)
class LoggerConfig:
    wandb: str = "auto"  # auto (online with a key, else offline) | online | offline | disabled
    project: str = "hpctrain"
    entity: str | None = None
    group: str | None = None
    run_name: str | None = None
    progress: str = "auto"  # auto | rich | plain


@dataclass(frozen=True)
class Config:
    task: str
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


def build(cls, group: str, values: dict[str, Any]):
    """Instantiate dataclass `cls` from `values`, rejecting unknown keys with a suggestion."""
    names = [f.name for f in fields(cls)]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" Did you mean {group}.{close[0]}?" if close else ""
            raise ValueError(
                f"unknown key {group}.{key}; valid keys: {', '.join(names)}.{hint}"
            )
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(f"{group}.{k}", v, hints[k]) for k, v in values.items()}
    return cls(**kwargs)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check a value against its field's type; lists become tuples, ints become floats."""
    base = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        base = next(a for a in args if a is not type(None))
    origin = typing.get_origin(base) or base
    if origin is tuple and isinstance(value, list | tuple):
        return tuple(value)
    if origin is dict and isinstance(value, dict):
        return value
    if origin is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if origin is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if origin in (str, bool) and isinstance(value, origin):
        return value
    raise ValueError(f"{key}={value!r} should be {getattr(origin, '__name__', origin)}")


_GROUPS = {
    "cluster": ClusterConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "logger": LoggerConfig,
    "model": ModelConfig,
}


def from_dict(raw: dict[str, Any], *, run_dir: str) -> Config:
    """Build a Config from a plain (resolved) dict; unknown top-level groups go to `extra`."""
    raw = dict(raw)
    task = raw.pop("task", {"name": "train"})
    task_name = task["name"] if isinstance(task, dict) else str(task)
    groups = {name: build(cls, name, raw.pop(name, {}) or {}) for name, cls in _GROUPS.items()}
    raw.pop("hydra", None)
    return Config(task=task_name, run_dir=run_dir, extra=raw, **groups)


def parse(cfg, *, run_dir: str | None = None) -> Config:
    """Hydra DictConfig → validated, frozen Config. Raises ValueError listing every mistake."""
    from omegaconf import OmegaConf

    from hpctrain.validate import validate

    group = None
    if run_dir is None:
        run_dir, group = _hydra_run_dir(), _hydra_sweep_group()
    raw = OmegaConf.to_container(cfg, resolve=True)
    config = from_dict(raw, run_dir=run_dir)
    if group is not None and config.logger.group is None:
        config = dataclasses.replace(
            config, logger=dataclasses.replace(config.logger, group=group))
    validate(config)
    return config


def _hydra_sweep_group() -> str | None:
    """In a multirun, the W&B group of the sweep (launch.sweep.sweep_group), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
    except (ImportError, ValueError):
        return None
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    from hpctrain.launch.sweep import sweep_group

    return sweep_group(hydra_cfg.sweep.dir)


def _hydra_run_dir() -> str:
    import os

    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.output_dir
    except (ImportError, ValueError):
        return os.getcwd()

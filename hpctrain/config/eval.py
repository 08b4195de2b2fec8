"""`eval.*` (task=eval): the settings and their checks, apart from the evaluator so that
validation and the schema read them without importing torch, the checkpoint reader or lm-eval."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpctrain.config.build import build
from hpctrain.config.rule import check, errors_of
from hpctrain.config.schema import Config
from hpctrain.distributed.device import cuda_available

LM_EVAL_EXTRA = "pip install 'hpctrain[eval]'"


@dataclass(frozen=True)
class EvalConfig:
    """`eval.*` (task=eval). `from_` is the key `eval.from` (config.config_key)."""

    # a run directory (its newest verified checkpoint) or a checkpoint directory; unset:
    # model.init_from=<a Hugging Face directory> is the model
    from_: str | None = None
    # run: the run's saved data.* and train.seq_len/batching/precision (.hydra/config.yaml);
    # config: this command's; auto: the run's when eval.from has a saved config, else this one's
    data: Literal["auto", "run", "config"] = "auto"
    split: Literal["val", "train"] = "val"
    samples: int | None = None  # None: train.eval_samples; 0: no loss (lm-eval only)
    micro_batch_size: int | None = None  # None: train.micro_batch_size
    device: Literal["auto", "cpu", "cuda"] = "auto"
    lm_eval_tasks: tuple[str, ...] = ()  # lm-eval task names; empty: no lm-eval
    lm_eval_include_path: str | None = None  # a directory of custom lm-eval task YAMLs
    limit: int | None = None  # lm-eval: at most this many documents per task
    num_fewshot: int | None = None  # lm-eval: None: each task's own default
    max_gen_toks: int = 256  # lm-eval generate_until: tokens generated at most per request


def eval_settings(extra: dict[str, Any], *, init_from: str | None) -> EvalConfig:
    """The `eval` group as an EvalConfig; ValueError naming every missing or contradicting
    key with the fix."""
    s = build(EvalConfig, "eval", extra.get("eval") or {})
    problems = _source_problems(s, init_from) + _count_problems(s) + _lm_eval_problems(s)
    if problems:
        raise ValueError("; ".join(problems))
    return s


def _source_problems(s: EvalConfig, init_from: str | None) -> list[str]:
    if s.from_ in (None, "???") and not init_from:
        return ["task=eval needs a model: eval.from=<run directory or checkpoint directory> "
                "(e.g. eval.from=outputs/run1), or model.init_from=<Hugging Face directory>"]
    if s.from_ not in (None, "???") and init_from:
        return [f"eval.from={s.from_} and model.init_from={init_from} both name the model: "
                "keep one"]
    if s.data == "run" and s.from_ in (None, "???"):
        return [f"eval.data=run reads the run's saved data settings, but model.init_from="
                f"{init_from} is no run: set eval.data=config with data.* (its tokenizer must "
                "be the model's)"]
    return []


def _count_problems(s: EvalConfig) -> list[str]:
    out = []
    if s.samples is not None and s.samples < 0:
        out.append(f"eval.samples={s.samples}: give 0 (no loss) or more samples")
    if s.micro_batch_size is not None and s.micro_batch_size < 1:
        out.append(f"eval.micro_batch_size={s.micro_batch_size}: give 1 or more")
    if s.samples and s.micro_batch_size and s.samples % s.micro_batch_size:
        out.append(f"eval.samples={s.samples} is not a multiple of eval.micro_batch_size="
                   f"{s.micro_batch_size}: use e.g. eval.samples="
                   f"{max(1, s.samples // s.micro_batch_size) * s.micro_batch_size}")
    for key, value in (("limit", s.limit), ("max_gen_toks", s.max_gen_toks)):
        if value is not None and value < 1:
            out.append(f"eval.{key}={value}: give 1 or more")
    if s.num_fewshot is not None and s.num_fewshot < 0:
        out.append(f"eval.num_fewshot={s.num_fewshot}: give 0 or more (or leave it unset)")
    if s.samples == 0 and not s.lm_eval_tasks:
        out.append("eval.samples=0 skips the loss and eval.lm_eval_tasks is empty: nothing to "
                   "evaluate; name lm-eval tasks (eval.lm_eval_tasks=[hellaswag]) or samples")
    return out


def _lm_eval_problems(s: EvalConfig) -> list[str]:
    out = []
    if s.lm_eval_include_path is not None and not s.lm_eval_tasks:
        out.append(f"eval.lm_eval_include_path={s.lm_eval_include_path} but eval.lm_eval_tasks "
                   "is empty: name the tasks to run, e.g. eval.lm_eval_tasks=[my_task]")
    if s.lm_eval_include_path is not None and not Path(s.lm_eval_include_path).is_dir():
        out.append(f"eval.lm_eval_include_path={s.lm_eval_include_path}: no such directory "
                   "(give the directory holding the task YAMLs)")
    if s.lm_eval_tasks and importlib.util.find_spec("lm_eval") is None:
        out.append(f"eval.lm_eval_tasks={list(s.lm_eval_tasks)} needs lm-eval: {LM_EVAL_EXTRA}")
    return out


@check("eval", "cluster.", "model.init_from")
def check_eval_task(c: Config) -> list[str]:
    """task=eval: eval.* known, typed and consistent, its device present; one process."""
    errs = errors_of(c, lambda cfg: eval_settings(cfg.extra, init_from=cfg.model.init_from))
    cl, device = c.cluster, (c.extra.get("eval") or {}).get("device")
    if cl.launcher == "slurm" and cl.world_size > 1:
        errs.append(f"task=eval runs in one process, but cluster.nodes={cl.nodes} × cluster."
                    f"procs_per_node={cl.procs_per_node} would start {cl.world_size} Slurm tasks"
                    ": set cluster.procs_per_node=1 (and cluster.gpus_per_node=1)")
    on_login_node = cl.launcher == "slurm" and "SLURM_PROCID" not in os.environ
    if device == "cuda" and not on_login_node and not cuda_available():
        errs.append("eval.device=cuda but no CUDA device is visible: use eval.device=auto")
    return errs

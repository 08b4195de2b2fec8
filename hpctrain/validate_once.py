"""The checks of the one-process tasks that load a model: task=export, task=eval and
task=generate, each problem named with its fix before anything is loaded. generate: its keys,
ranges, model source, prompts and device. (That a prompt and its new tokens fit the
model's context is checked again per prompt once it is tokenised: hpctrain.train.generate.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from hpctrain.config import Config
from hpctrain.distributed.device import cuda_available
from hpctrain.models.hf_config import export_family
from hpctrain.train.eval_config import eval_settings
from hpctrain.train.export_config import export_settings
from hpctrain.train.generate_config import (
    GenerateConfig,
    generate_settings,
    read_prompts,
    source_problems,
)
from hpctrain.validate_keys import Range, at_least, positive, range_problems
from hpctrain.validate_pipeline import _errors_of

GENERATE_RANGES: dict[str, Range] = {
    "generate.max_new_tokens": positive("e.g. generate.max_new_tokens=64"),
    "generate.temperature": at_least(0, "0 for greedy, e.g. generate.temperature=0.8 to "
                                        "sample"),
    "generate.top_k": at_least(0, "0 keeps every token, e.g. generate.top_k=50"),
    "generate.top_p": Range(lo=0, hi=1, lo_open=True, fix="1 keeps every token, e.g. "
                                                          "generate.top_p=0.9"),
}


def check_generate(c: Config) -> list[str]:
    """Every problem of the generate group (and model.init_from as its source)."""
    try:
        s = generate_settings(c.extra)
    except ValueError as err:  # unknown or mistyped keys: the rest would read defaults
        return [str(err)]
    values = {f"generate.{f.name}": getattr(s, f.name) for f in dataclasses.fields(s)}
    errs = [p.text for p in range_problems(values, GENERATE_RANGES)]
    errs += source_problems(s, c.model.init_from)
    try:
        read_prompts(s)
    except ValueError as err:
        errs.append(str(err))
    if s.device == "cuda" and not cuda_available():
        errs.append("generate.device=cuda but no CUDA device is visible: use "
                    "generate.device=auto (or cpu)")
    return errs + _context_problems(s, c)


def _context_problems(s: GenerateConfig, c: Config) -> list[str]:
    """With model.init_from the context is known now: the new tokens and at least one prompt
    token must fit in it."""
    if c.model.init_from is None or s.from_ is not None or s.max_new_tokens < 1:
        return []
    if s.max_new_tokens < c.model.max_seq_len:
        return []
    return [f"generate.max_new_tokens={s.max_new_tokens} leaves no room for a prompt in the "
            f"model's context of {c.model.max_seq_len} tokens (model.max_seq_len): set "
            f"generate.max_new_tokens={c.model.max_seq_len - 1} or fewer"]


def check_export_every(c: Config) -> list[str]:
    """train.export_every: kept checkpoints exist at its multiples, the model has a Hugging
    Face form, and safetensors is installed (hpctrain.train.exports)."""
    t, errs = c.train, []
    if not t.export_every:
        return []
    if not t.keep_every or t.export_every % t.keep_every:
        errs.append(f"train.export_every={t.export_every} is not a multiple of train.keep_every"
                    f"={t.keep_every}: exports read checkpoints kept for good (retention could "
                    f"delete another during its export): set train.keep_every={t.export_every}")
    if not t.checkpoint_every or t.export_every % t.checkpoint_every:
        errs.append(f"train.export_every={t.export_every} is not a multiple of "
                    f"train.checkpoint_every={t.checkpoint_every}, so no checkpoint is saved at "
                    f"its steps: set train.checkpoint_every to a divisor of {t.export_every}")
    family, why = export_family(c.model)
    if why:
        errs.append(f"train.export_every={t.export_every}: model {c.model.name} has no exact "
                    f"Hugging Face form ({'; '.join(why)}): set train.export_every=0")
    if importlib.util.find_spec("safetensors") is None:
        errs.append(f"train.export_every={t.export_every} writes safetensors, which is not "
                    "installed: pip install 'hpctrain[hf]'")
    return errs


def check_export(c: Config) -> list[str]:
    """task=export: export.from and export.out are given, export.* keys known and typed."""
    return _errors_of(c, lambda cfg: export_settings(cfg.extra))


def check_eval_task(c: Config) -> list[str]:
    """task=eval: eval.* known, typed and consistent, its device present; one process."""
    errs = _errors_of(c, lambda cfg: eval_settings(cfg.extra, init_from=cfg.model.init_from))
    cl, device = c.cluster, (c.extra.get("eval") or {}).get("device")
    if cl.launcher == "slurm" and cl.world_size > 1:
        errs.append(f"task=eval runs in one process, but cluster.nodes={cl.nodes} × cluster."
                    f"procs_per_node={cl.procs_per_node} would start {cl.world_size} Slurm tasks"
                    ": set cluster.procs_per_node=1 (and cluster.gpus_per_node=1)")
    on_login_node = cl.launcher == "slurm" and "SLURM_PROCID" not in os.environ
    if device == "cuda" and not on_login_node and not cuda_available():
        errs.append("eval.device=cuda but no CUDA device is visible: use eval.device=auto")
    return errs

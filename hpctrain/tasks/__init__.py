"""Every task `python -m hpctrain task=<name>` runs, in one table (`TASKS`): where it runs (once
in this process, or on every rank), the rules its configuration must pass, what it runs and what
it shows on stdout. A task's config group is `hpctrain.config.<name>`, its runner
`hpctrain.tasks.<name>`; `hpctrain.dispatch` runs it.

`problems(c)` lists what the rules of c's task find (`hpctrain.tasks.configure.parse` raises
them for the entry points).

Runners are imported when their task runs: a rank, or `python -m hpctrain` launching ranks,
does not pay for the modules of the tasks it does not run (the planner's, the exporter's,
torch.distributed.checkpoint's: seconds per process on a small CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.checkpoint.catalog import check_resume, check_run_dir
from hpctrain.checkpoint.hf_checks import check_init_from
from hpctrain.config.bench import check_bench, needs_data
from hpctrain.config.build import Problem
from hpctrain.config.dryrun import check_dryrun
from hpctrain.config.eval import check_eval_task
from hpctrain.config.export import check_export, check_export_every
from hpctrain.config.generate import check_generate
from hpctrain.config.rule import Check
from hpctrain.config.schema import Config
from hpctrain.config.simulate import check_simulate
from hpctrain.config.validate import problems_of
from hpctrain.config.validate.batch import check_batch
from hpctrain.config.validate.cluster import check_elastic, check_local_nodes, check_signal_delay
from hpctrain.config.validate.device import check_attention, check_device, check_fp8
from hpctrain.config.validate.layout import (
    check_cp,
    check_hsdp,
    check_moe,
    check_not_built,
    check_world,
)
from hpctrain.config.validate.model import check_head_dim, check_model_shape
from hpctrain.config.validate.pipeline import check_pipeline, check_schedule
from hpctrain.data.checks import (
    check_cache_dir,
    check_data_paths,
    check_data_size,
    check_format,
    check_model_tokenizer,
    check_tokenizer,
    check_vocab,
)
from hpctrain.data.packing import check_packing
from hpctrain.plan.checks import check_cluster_spec, check_plan
from hpctrain.train.eval_set import check_eval
from hpctrain.train.optim import check_lr_schedule, check_optim

Result = dict[str, Any]


@dataclass(frozen=True)
class Task:
    """What `task=<name>` is. `run` takes the Config (and, `on_ranks`, the rank's Mesh) and
    returns the result `show` formats for stdout (None: nothing to show); `reads_data` says
    whether this configuration of it reads the data and checkpoints (their checks then run)."""

    name: str
    run: Callable[..., Result]
    checks: tuple[Check, ...]
    show: Callable[[Result], str | None]
    on_ranks: bool = False
    reads_data: Callable[[Config], bool] = lambda c: False
    modules: tuple[str, ...] = ()  # what `run` imports on a rank (a fork server preloads it)


# The rules of a training run, in the order their problems are listed.
TRAIN_CHECKS: tuple[Check, ...] = (
    check_local_nodes, check_resume, check_run_dir, check_data_paths, check_format,
    check_tokenizer, check_cache_dir,
    check_cp, check_world, check_hsdp, check_signal_delay, check_elastic, check_optim,
    check_lr_schedule, check_head_dim, check_model_shape, check_batch, check_eval,
    check_packing, check_vocab, check_init_from, check_model_tokenizer, check_data_size,
    check_device,
    check_attention, check_fp8, check_not_built, check_moe, check_schedule, check_pipeline,
    check_cluster_spec, check_bench, check_export_every)


# -- runners, imported when their task runs -----------------------------------------------------
def _train(cfg: Config, mesh) -> Result:
    from hpctrain.tasks.train import run_train

    return run_train(cfg, mesh)


def _bench(cfg: Config, mesh) -> Result:
    from hpctrain.tasks.bench import run_bench

    return run_bench(cfg, mesh)


def _simulate(cfg: Config) -> Result:
    from hpctrain.tasks.simulate import run_simulate

    return run_simulate(cfg)


def _plan(cfg: Config) -> Result:
    from hpctrain.tasks.plan import run_plan

    return run_plan(cfg)


def _prepare(cfg: Config) -> Result:
    from hpctrain.tasks.prepare import run_prepare

    return run_prepare(cfg)


def _export(cfg: Config) -> Result:
    from hpctrain.tasks.export import run_export

    return run_export(cfg)


def _show_export(result: Result) -> str:
    from hpctrain.checkpoint.hf_export import export_summary

    return export_summary(result)


def _generate(cfg: Config) -> Result:
    from hpctrain.tasks.generate.generate import run_generate

    return run_generate(cfg)


def _eval(cfg: Config) -> Result:
    from hpctrain.tasks.eval.evaluate import run_eval

    return run_eval(cfg)


def _compat(cfg: Config) -> Result:
    from hpctrain.tasks.compat import run_compat

    return run_compat(cfg)


def _dryrun(cfg: Config) -> Result:
    from hpctrain.tasks.dryrun.run import run_dryrun

    return run_dryrun(cfg)


# -- what each shows on stdout ------------------------------------------------------------------
def _show_summary(result: Result) -> str:
    from hpctrain.train.outputs import format_summary

    return format_summary(result)


def _show_bench(result: Result) -> str:
    report = Path(result["report"])
    body = report.read_text() if report.exists() else ""
    return f"{body}\noutputs: {result['report']}, {result['json']}"


def _show_text(result: Result) -> str:
    return f"{result['text']}\noutputs: {result['path']}"


def _show_simulation(result: Result) -> str:
    return f"{result['text']}\noutputs: {result['json']}, {result['timeline_png']}"


def _show_generations(result: Result) -> str:
    from hpctrain.tasks.generate.generate import format_generations

    return format_generations(result)


def _show_eval(result: Result) -> str:
    from hpctrain.tasks.eval.evaluate import format_eval

    return format_eval(result)


def _bench_reads_data(c: Config) -> bool:
    try:
        return needs_data(c.extra)
    except ValueError:  # a bad bench group: check_bench reports it
        return False


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("train", _train, TRAIN_CHECKS, _show_summary, on_ranks=True,
         reads_data=lambda c: True, modules=("hpctrain.tasks.train",)),
    Task("bench", _bench, TRAIN_CHECKS, _show_bench, on_ranks=True,
         reads_data=_bench_reads_data, modules=("hpctrain.tasks.bench",)),
    # task=simulate runs no ranks, trains nothing: only the schedule and its costs matter.
    Task("simulate", _simulate, (check_simulate,), _show_simulation),
    # The planner predicts any layout, including ones this version cannot run yet.
    Task("plan", _plan, (check_cp, check_world, check_head_dim, check_model_shape, check_batch,
                         check_schedule, check_plan), _show_text),
    # task=prepare tokenises the data once, no ranks: only what it reads and writes matters.
    Task("prepare", _prepare, (check_data_paths, check_format, check_tokenizer,
                               check_cache_dir),
         lambda r: f"prepared tokens: {r['data_dir']}", reads_data=lambda c: True),
    # task=export reads one checkpoint, no ranks, no data: its model comes from the checkpoint.
    Task("export", _export, (check_export,), _show_export),
    # task=generate samples from one model on one device: its model and prompts matter.
    Task("generate", _generate, (check_generate, check_init_from), _show_generations),
    # task=eval: one process; its data and model come from the run (or eval.*, data.*).
    Task("eval", _eval, (check_eval_task, check_init_from), _show_eval),
    # task=compat validates its own cells (hpctrain.tasks.compat), whatever else is configured.
    Task("compat", _compat, (), _show_text),
    # task=dryrun sets up ranks of the job on meta tensors here: everything a training run
    # checks but the data and this machine's devices (the job's are elsewhere).
    Task("dryrun", _dryrun, (*(k for k in TRAIN_CHECKS if k not in (check_device,
                                                                     check_attention)),
                             check_dryrun), _show_text),
)}


def reads_data(c: Config) -> bool:
    """Whether `c`'s task reads the data (and checkpoints): train, bench=train, prepare."""
    task = TASKS.get(c.task)
    return task is not None and task.reads_data(c)


def problems(c: Config, *, found: Sequence[Problem] = ()) -> list[Problem]:
    """Every problem of `c` under its task's rules (hpctrain.config.validate.problems_of)."""
    task = TASKS.get(c.task)
    return problems_of(c, task.checks if task else (), reads_data=reads_data(c), found=found)


def runnable_problems(c: Config) -> list[str]:
    """Why hpctrain would refuse to run `c` (empty when it runs): what parallel=auto asks of
    every candidate layout."""
    return [p.text for p in problems(c)]

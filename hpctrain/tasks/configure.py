"""The entry points' one way from Hydra's composed config to the Config a task runs with:
built and key-checked (`hpctrain.config.parse`), its layout chosen by the planner when
parallel=auto, checked by the task's rules (`hpctrain.tasks.problems`), and a training layout
predicted not to fit refused. `python -m hpctrain`, `python -m hpctrain.launch.sbatch` and the
sweep's check call it right after composing; a rank never does (it imports no Hydra)."""

from __future__ import annotations

from hpctrain.config.build import Problem, format_problems
from hpctrain.config.parse import read_config
from hpctrain.config.plan import plan_setting_problems
from hpctrain.config.schema import Config
from hpctrain.config.validate.keys import key_problems
from hpctrain.plan.auto import choose_layout, fit_problems
from hpctrain.tasks import problems, runnable_problems


def parse(cfg, *, run_dir: str | None = None, overrides: list[str] | None = None) -> Config:
    """Hydra DictConfig → the validated, frozen Config its task runs with (module docstring).
    Raises one ValueError listing every mistake, each with its fix. `run_dir` and `overrides`:
    hpctrain.config.parse.read_config."""
    config, found = read_config(cfg, run_dir=run_dir, overrides=overrides)
    if config.parallel.auto and not found and config.task != "simulate":
        # the search would read these (a rank count of 0 makes every layout look wrong)
        bad = [*key_problems(config),
               *(Problem("plan", text) for text in plan_setting_problems(config))]
        if bad:
            raise ValueError(format_problems(bad))
        config = choose_layout(config, accept=runnable_problems)[0]
    listed = problems(config, found=found)
    if listed:
        raise ValueError(format_problems(listed))
    refused = fit_problems(config, accept=runnable_problems)
    if refused:
        raise ValueError(format_problems(refused))
    return config

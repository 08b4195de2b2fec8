"""From Hydra's composed config to a validated, frozen Config: `parse(cfg)`.

The Hydra entry points (`python -m hpctrain`, `python -m hpctrain.launch.sbatch`, the sweep
callback) call it right after composing. It sits above `hpctrain.validate` (which reads every
component's rules) and below `hpctrain.launch`, so `hpctrain.config` stays the plain schema
that every layer reads and imports nothing above it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from hpctrain.config import Config, collect
from hpctrain.config_build import Problem, format_problems
from hpctrain.plan.auto import FIXABLE, choose_layout, fit_problems, fixed_value
from hpctrain.validate import problems_of, validate
from hpctrain.validate_keys import key_problems, key_value


def parse(cfg, *, run_dir: str | None = None, overrides: list[str] | None = None) -> Config:
    """Hydra DictConfig → validated, frozen Config. Raises one ValueError listing every
    mistake (hpctrain.validate), each with its fix. Without `run_dir`, Hydra's output dir (or
    the working directory outside Hydra); in a multirun, logger.group defaults to the sweep's
    `sweep_group`. parallel=auto is resolved here (`hpctrain.plan.auto.choose_layout`), and a
    training layout predicted not to fit is refused (`fit_problems`, unless plan.force).
    `overrides` (default: Hydra's, of this job): with parallel=auto, the layout keys among them
    are kept as given (`parallel.fixed`)."""
    group = None
    if run_dir is None:
        run_dir, group = _hydra_run_dir(), _hydra_sweep_group()
    raw = OmegaConf.to_container(cfg, resolve=True)
    config, problems = collect(raw, run_dir=run_dir)
    if config is None:
        raise ValueError(format_problems(problems))
    if group is not None and config.logger.group is None:
        config = dataclasses.replace(
            config, logger=dataclasses.replace(config.logger, group=group))
    config, fixed_errors = _with_fixed(config, _hydra_overrides() if overrides is None
                                       else overrides)
    problems = [*problems, *fixed_errors]
    if config.parallel.auto and not problems and config.task != "simulate":
        bad_keys = key_problems(config)  # the search would read them (a rank count of 0)
        if bad_keys:
            raise ValueError(format_problems(bad_keys))
        config = choose_layout(config, accept=runnable_problems)[0]
    validate(config, found=problems)
    refused = fit_problems(config, accept=runnable_problems)
    if refused:
        raise ValueError(format_problems(refused))
    return config


_OVERRIDE_KEY = re.compile(r"^\+{0,2}([\w.]+)=")


def _with_fixed(config: Config, overrides: list[str]) -> tuple[Config, list[Problem]]:
    """`config` whose parallel.fixed holds `key=value` for every key it names and every layout
    key among `overrides` (parallel=auto only), the values as given before the search; and the
    problems of parallel.fixed: names outside FIXABLE, values of the wrong type, set without
    auto."""
    given = [m.group(1) for o in overrides if (m := _OVERRIDE_KEY.match(o))]
    p = config.parallel
    if not p.auto:
        if p.fixed:
            return config, [Problem("parallel.fixed", f"parallel.fixed={list(p.fixed)} only "
                                    "applies to parallel=auto: remove it, or add parallel=auto")]
        return config, []
    entries: dict[str, str] = {}
    for item in [*p.fixed, *(k for k in given if k in FIXABLE)]:
        name, sep, text = item.partition("=")
        if name not in FIXABLE:
            return config, [Problem("parallel.fixed", f"parallel.fixed has {name!r}: choose "
                                    f"from {', '.join(FIXABLE)}")]
        current = key_value(config, name)
        if not sep:
            text = str(current).lower() if isinstance(current, bool) else str(current)
        try:
            fixed_value(current, text)
        except ValueError:
            kind = ("true or false" if isinstance(current, bool) else "a whole number"
                    if isinstance(current, int) else "a name")
            return config, [Problem("parallel.fixed", f"parallel.fixed has {item!r}: "
                                    f"{name} takes {kind}")]
        entries.setdefault(name, text)
    fixed = tuple(f"{name}={text}" for name, text in entries.items())
    return dataclasses.replace(config, parallel=dataclasses.replace(p, fixed=fixed)), []


def _hydra_overrides() -> list[str]:
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not inside a Hydra run
        return []


def runnable_problems(config: Config) -> list[str]:
    """Why hpctrain would refuse to run `config` (empty when it runs): what parallel=auto asks
    of every candidate layout."""
    return [p.text for p in problems_of(config)]


def sweep_group(sweep_dir: str | Path) -> str:
    """W&B group of a sweep: the sweep dir's name with its parent (`2024-05-01_12-30-00`
    for the default `multirun/2024-05-01/12-30-00`), unique across days."""
    p = Path(sweep_dir)
    return f"{p.parent.name}_{p.name}" if p.parent.name else p.name


def _hydra_sweep_group() -> str | None:
    """In a multirun, the W&B group of the sweep, else None."""
    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not inside a Hydra run
        return None
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return sweep_group(hydra_cfg.sweep.dir)


def _hydra_run_dir() -> str:
    try:
        return HydraConfig.get().runtime.output_dir
    except ValueError:  # not inside a Hydra run
        return os.getcwd()

"""From Hydra's composed config to a frozen Config: `read_config(cfg)`.

What it finds while building (unknown, missing and mistyped keys) it returns with the Config;
`hpctrain.tasks.configure.parse` adds the rules of the task (hpctrain.config.validate) and the
layout parallel=auto chooses, for the Hydra entry points (`python -m hpctrain`, `python -m
hpctrain.launch.sbatch`, the sweep callback).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from hpctrain.config.build import Problem, format_problems
from hpctrain.config.schema import FIXABLE, Config, collect, fixed_value
from hpctrain.config.validate.keys import key_value


def read_config(cfg, *, run_dir: str | None = None,
                overrides: list[str] | None = None) -> tuple[Config, list[Problem]]:
    """Hydra's DictConfig as a frozen Config, with the problems found building it (unknown,
    missing and mistyped keys; parallel.fixed); ValueError (one message listing them) when no
    Config can be built. Without `run_dir`, Hydra's output dir (or the working directory outside
    Hydra); in a multirun, logger.group defaults to the sweep's `sweep_group`. `overrides`
    (default: Hydra's, of this job): with parallel=auto, the layout keys among them are kept as
    given (`parallel.fixed`)."""
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
    return config, [*problems, *fixed_errors]


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

"""Validate every point of a sweep before anything is submitted.

Hydra hands the launcher one override list per point only after the multirun has started, so
the sweep callback expands the command line's sweep overrides itself (Hydra's own override
parser: `a=1,2 b=x,y` → 4 points, ranges and choice() included), composes and parses each point
as its job would, and raises one ValueError naming every bad point. Nothing is queued on Slurm
for a sweep with a mistake in it.
"""

from __future__ import annotations

import itertools
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from hpctrain.tasks.configure import parse


def sweep_points(task_overrides: list[str]) -> list[list[str]]:
    """The override list of every point, in Hydra's BasicSweeper order (last key fastest)."""
    parsed = OverridesParser.create().parse_overrides(task_overrides)
    choices = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(point) for point in itertools.product(*choices)]


def parsed_points(config: DictConfig, *, run_dir: str) -> list[Any]:
    """Compose and validate every point; ValueError listing each failing point and why."""
    points = sweep_points(list(config.hydra.overrides.task))
    parsed, errors = [], []
    for i, overrides in enumerate(points):
        try:
            parsed.append(parse(compose(config_name="config", overrides=overrides),
                                run_dir=run_dir, overrides=overrides))
        except ValueError as err:
            errors.append(f"point {i} ({' '.join(overrides) or 'no overrides'}): {err}")
    if errors:
        raise ValueError(f"{len(errors)} of {len(points)} sweep point(s) are invalid; nothing "
                         "was launched:\n" + "\n".join(errors))
    return parsed

"""The typed dataclasses as Hydra schemas: one source of truth for every key and default.

Each config group's keys and defaults are the fields of its dataclass (`SCHEMAS`). `register()`
stores, for every group, a node `schema/<group>` holding those defaults in Hydra's ConfigStore;
conf/config.yaml lists them first (task=plan and task=simulate add theirs), so a YAML option holds
only what differs from the dataclass, and tests/unit/test_config_schema.py fails when one
restates a default or the default option contradicts it.

The node is a plain mapping of the defaults, not a structured config: OmegaConf does not accept
`Literal` annotations, and a structured node would type-check values inside Hydra and refuse
`~key` deletion. So Hydra supplies every key and its default, refuses a typo on the command line
(`train.stpes=3`), and hands everything else — `+group.unknown=1`, a value of the wrong type or
outside its choices — to `hpctrain.tasks.configure.parse`, which reports all of them in one
ValueError. Fields without a default (the model's shape) are left out: a preset sets them, and
parse names the ones still missing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore

from hpctrain.config.bench import BenchConfig
from hpctrain.config.build import config_key
from hpctrain.config.dryrun import DryrunConfig
from hpctrain.config.eval import EvalConfig
from hpctrain.config.export import ExportConfig
from hpctrain.config.generate import GenerateConfig
from hpctrain.config.plan import PlanConfig
from hpctrain.config.schema import RUN_GROUPS, TaskConfig
from hpctrain.config.simulate import SimulateConfig

# Every group Hydra composes → its dataclass. bench/plan/simulate/export/eval/dryrun reach
# Config.extra and are built by their tasks (bench.config.bench_config, plan.task.plan_settings,
# sim_task, export_config.export_settings, eval_config.eval_settings,
# dryrun_config.dryrun_settings).
SCHEMAS: dict[str, type] = {**RUN_GROUPS, "task": TaskConfig, "bench": BenchConfig,
                            "plan": PlanConfig, "simulate": SimulateConfig,
                            "export": ExportConfig, "generate": GenerateConfig,
                            "eval": EvalConfig, "dryrun": DryrunConfig}


def defaults_of(cls: type) -> dict[str, Any]:
    """Field → default of dataclass `cls`, as plain YAML values (tuples become lists); fields
    without a default are left out."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        if dataclasses.is_dataclass(value):  # a nested group (model.moe): its own defaults
            value = defaults_of(type(value))
        out[config_key(f.name)] = list(value) if isinstance(value, tuple) else value
    return out


def register() -> None:
    """Store `schema/<group>` for every group of SCHEMAS in Hydra's ConfigStore (idempotent).
    Call it before composing conf/ (the entry point, hpctrain.launch.sbatch and the tests do)."""
    store = ConfigStore.instance()
    for group, cls in SCHEMAS.items():
        store.store(group="schema", name=group, node=defaults_of(cls),
                    provider="hpctrain")

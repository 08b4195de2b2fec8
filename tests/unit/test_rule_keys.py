"""Every rule names the keys it reads (hpctrain.config.rule), and those keys exist: a key that
is renamed or removed without its rules fails here, naming the rule. The rules a task runs are
its entry in hpctrain.tasks.TASKS."""

from __future__ import annotations

import dataclasses
import typing

from hpctrain.config.build import config_key, type_hints
from hpctrain.config.schema import RUN_GROUPS, TASK_GROUPS, Task
from hpctrain.tasks import TASKS


def _keys(prefix: str, cls: type) -> set[str]:
    out = set()
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{config_key(f.name)}"
        out.add(key)
        if dataclasses.is_dataclass(hints[f.name]):  # a nested group: model.moe
            out |= _keys(key, hints[f.name])
    return out


KEYS = {k for group, cls in RUN_GROUPS.items() for k in _keys(group, cls)}


HYDRA_KEYS = {"hydra.run.dir"}  # Hydra's own, which sets Config.run_dir


def _exists(read: str) -> bool:
    if read in TASK_GROUPS or read in KEYS or read in HYDRA_KEYS:
        return True
    return read.endswith(".") and any(k.startswith(read) for k in KEYS)


def test_every_rule_reads_keys_that_exist():
    bad = {(task.name, check.__name__, read) for task in TASKS.values()
           for check in task.checks for read in check.reads if not _exists(read)}
    assert not bad, sorted(bad)


def test_every_task_has_an_entry_and_every_rule_names_its_keys():
    assert set(TASKS) == set(typing.get_args(Task))
    assert all(check.reads for task in TASKS.values() for check in task.checks)

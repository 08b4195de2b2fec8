"""One source of truth: the dataclasses own every key, default and choice; YAML holds only
what differs from them (hpctrain.config.hydra_schema).

`yaml_problems` reads every option file under conf/ and reports a value that restates its
default (the dataclass's, or the option it inherits from) and, in the default option of each
group (the one conf/config.yaml selects), any value the dataclass would not give: drift.
"""

from __future__ import annotations

import dataclasses
import shutil
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from hpctrain.config.build import build, literal_choices
from hpctrain.config.hydra_schema import SCHEMAS, defaults_of
from hpctrain.config.schema import RUN_GROUPS
from hpctrain.config.validate.keys import REGISTRY_CHOICES, literal_table
from tests.conftest import CONF, compose


def _plain(value: Any) -> Any:
    """Lists as tuples (YAML lists vs dataclass tuples), recursively."""
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    return value


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kind (1 == 1.0 counts, True == 1 does not)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return _plain(a) == _plain(b)


def _read(path: Path) -> tuple[dict[str, dict], list[str]]:
    """group → its values in the file, and the sibling options it inherits (defaults list)."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    parents = [d for d in raw.pop("defaults", []) if isinstance(d, str) and d != "_self_"
               and not d.startswith("/")]
    if path.read_text().startswith("# @package _global_"):
        return {g: v for g, v in raw.items() if g in SCHEMAS}, parents
    return {path.parent.name: raw}, parents


def _merge(into: dict, values: dict) -> None:
    """Deep-merge `values` into `into`, as Hydra merges a defaults list (model.moe key by key)."""
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _inherited(path: Path) -> dict[str, dict]:
    """group → values the options `path` inherits from set (their own parents first)."""
    values: dict[str, dict] = {}
    for parent in _read(path)[1]:
        parent_path = path.parent / f"{parent}.yaml"
        for source in (_inherited(parent_path), _read(parent_path)[0]):
            _merge(values, {group: dict(keys or {}) for group, keys in source.items()})
    return values


def _default_options(conf: Path) -> set[Path]:
    """The option file of each group that conf/config.yaml selects."""
    entries = OmegaConf.to_container(OmegaConf.load(conf / "config.yaml"))["defaults"]
    return {conf / group / f"{option}.yaml" for entry in entries if isinstance(entry, dict)
            for group, option in entry.items() if group in SCHEMAS}


def _nested_schema(cls: type, name: str) -> type | None:
    """The dataclass of field `name` when it is a nested group (model.moe), else None."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    default = (field.default_factory() if field.default_factory is not dataclasses.MISSING
               else field.default)
    return type(default) if dataclasses.is_dataclass(default) else None


def _problems(values: dict, cls: type, *, prefix: str, where: str, base: dict,
              default_option: bool) -> list[str]:
    """Unknown keys, restated defaults and (in a group's default option) drift among `values`,
    the keys of dataclass `cls` at `prefix` (e.g. model.moe); `base`: what the file inherits
    there. A nested dataclass field is checked key by key, as deep as it goes."""
    problems, schema = [], defaults_of(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in (values or {}).items():
        at = f"{where}: {prefix}.{key}={value!r}"
        if key not in names:
            problems.append(f"{at} is not a field of {cls.__name__}")
            continue
        nested = _nested_schema(cls, key)
        if nested is not None and isinstance(value, dict):
            problems += _problems(value, nested, prefix=f"{prefix}.{key}", where=where,
                                  base=base.get(key) or {}, default_option=default_option)
            continue
        if isinstance(value, str) and "${" in value:
            continue  # computed (resolver, environment), not a restated literal
        if key in base or key in schema:
            if _same(value, base[key] if key in base else schema[key]):
                problems.append(f"{at} restates the default: delete the line")
        if default_option and key in schema and not _same(value, schema[key]):
            problems.append(f"{at} in the default option contradicts "
                            f"{cls.__name__}.{key}={schema[key]!r}: "
                            "change the dataclass default (drift)")
    return problems


def yaml_problems(conf: Path) -> list[str]:
    """Every restated default, drifted default-option value and unknown key under `conf`,
    nested groups (model.moe) included."""
    problems, default_options = [], _default_options(conf)
    for path in sorted(p for p in conf.glob("*/*.yaml") if p.parent.name in SCHEMAS):
        inherited = _inherited(path)
        for group, values in _read(path)[0].items():
            problems += _problems(values, SCHEMAS[group], prefix=group,
                                  where=str(path.relative_to(conf)),
                                  base=inherited.get(group, {}),
                                  default_option=path in default_options)
    return problems


def test_yaml_holds_only_differences_from_the_schema():
    assert yaml_problems(CONF) == []


def test_restated_and_drifted_values_are_found(tmp_path):
    """The check itself can fail: a restated key, a drifted default, a typo, and the same
    inside a nested group (model.moe)."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    with (conf / "train" / "default.yaml").open("a") as f:
        f.write("steps: 200\neval_every: 100\n")
    with (conf / "train" / "debug.yaml").open("a") as f:
        f.write("stpes: 3\n")
    with (conf / "cluster" / "slurm_local.yaml").open("a") as f:
        f.write("  launcher: slurm\n")  # what cluster/slurm.yaml (its parent) already sets
    with (conf / "model" / "debug_moe.yaml").open("a") as f:
        f.write("  top_k: 2\n  tpo_k: 3\n")  # inside its `moe:` block, the file's last
    found = "\n".join(yaml_problems(conf))
    assert "train/default.yaml: train.steps=200 restates the default" in found
    assert "train.eval_every=100 in the default option contradicts" in found
    assert "TrainConfig.eval_every=50" in found
    assert "train.stpes=3 is not a field of TrainConfig" in found
    assert "cluster/slurm_local.yaml: cluster.launcher='slurm' restates" in found
    assert "model/debug_moe.yaml: model.moe.top_k=2 restates the default" in found
    assert "model.moe.tpo_k=3 is not a field of MoEConfig" in found
    assert len(yaml_problems(conf)) == 6


@pytest.mark.parametrize("group", sorted(set(SCHEMAS) - {"plan", "simulate", "export",
                                                         "generate", "eval", "dryrun"}))
def test_composed_group_has_every_key_and_default(group):
    """With no overrides Hydra supplies every field (what `--cfg job` prints) at the
    dataclass default; the model preset adds its shape."""
    composed = OmegaConf.to_container(compose(["task=bench"] if group == "bench" else []),
                                      resolve=True)[group]
    names = [f.name for f in dataclasses.fields(SCHEMAS[group])]
    assert sorted(composed) == sorted(names)
    schema = defaults_of(SCHEMAS[group])
    differ = {k: v for k, v in composed.items() if k in schema and not _same(v, schema[k])}
    assert differ == {} or (group == "data" and set(differ) <= {"cache_dir"})  # environment


@pytest.mark.parametrize("task", ["plan", "simulate", "export", "generate", "eval", "dryrun"])
def test_task_groups_are_typed(task):
    composed = compose([f"task={task}"])[task]
    assert OmegaConf.to_container(composed) == defaults_of(SCHEMAS[task])
    with pytest.raises(ValueError, match=f"{task}.[a-z_]+='x' should be"):
        build(SCHEMAS[task], task, {"top": "x"} if task == "plan" else
              {"max_shard_mb": "x"} if task == "export" else
              {"top_p": "x"} if task == "generate" else
              {"samples": "x"} if task == "eval" else {next(iter(composed)): "x"})


def test_choices_come_from_the_literal_annotations():
    table = literal_table()
    assert table["train.precision"] == ("fp32", "bf16", "fp16")
    assert table["task"] == ("train", "simulate", "bench", "plan", "prepare",
                             "export", "generate", "eval", "compat", "dryrun")
    hints = {f"{g}.{k}": h for g, cls in RUN_GROUPS.items()
             for k, h in typing.get_type_hints(cls).items()}
    assert all(literal_choices(hints[k]) == table[k] for k in table if k != "task")
    assert not set(REGISTRY_CHOICES) & set(table)  # a registry key is not also a Literal
    with pytest.raises(ValueError, match="train.precision='fp64' is not one of 'fp32', "
                                         "'bf16', 'fp16': did you mean train.precision=fp16"):
        build(RUN_GROUPS["train"], "train", {"precision": "fp64"})

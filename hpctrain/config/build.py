"""Building typed frozen dataclasses from plain dicts, with one message per mistake.

`build_checked` turns a group of keys into its dataclass and reports every unknown key (with a
"did you mean"), missing key and mistyped value (`Problem`s naming the fix); `Literal[...]`
fields take only their listed values. `hpctrain.config.schema` builds the run configuration with it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import keyword
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Literal


@dataclass(frozen=True)
class Problem:
    """One mistake in a configuration: the key it is about and the message with the fix."""

    key: str
    text: str


def format_problems(problems: list[Problem] | list[str]) -> str:
    """One message listing every problem once, in order."""
    texts = list(dict.fromkeys(p.text if isinstance(p, Problem) else p for p in problems))
    bullet = "\n  - "
    return f"invalid configuration ({len(texts)} problem(s)):{bullet}" + bullet.join(texts)


@functools.cache
def type_hints(cls) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, evaluated once per class (it re-evaluates every string
    annotation on each call: 27 of the 37 s that validating 2,643 configs took)."""
    return typing.get_type_hints(cls)


def build(cls, group: str, values: dict[str, Any]):
    """Instantiate dataclass `cls` from `values`; one ValueError naming every unknown (with a
    suggestion), missing or mistyped key of the group."""
    obj, problems = build_checked(cls, group, values)
    if problems:
        raise ValueError("; ".join(p.text for p in problems))
    return obj


def build_checked(cls, group: str, values: Any) -> tuple[Any, list[Problem]]:
    """`cls` from `values` and the problems found. A mistyped key takes its default (and is
    reported), so later checks still see a whole config; None when a required key is bad."""
    if not isinstance(values, dict):
        return None, [Problem(group, f"{group}={values!r} must be a group of keys "
                                     f"({group}.<key>=<value>)")]
    names = {config_key(f.name): f for f in fields(cls)}
    problems = [unknown_key(group, key, list(names)) for key in values if key not in names]
    hints, kwargs = type_hints(cls), {}
    for name, value in values.items():
        if name in names:
            f = names[name]
            try:
                kwargs[f.name] = _coerce(f"{group}.{name}", value, hints[f.name])
            except ChoiceError as err:  # names the allowed values and the closest one
                problems.append(Problem(f"{group}.{name}", str(err)))
            except ValueError as err:
                problems.append(Problem(f"{group}.{name}",
                                        f"{err}{_example(group, f, hints[f.name])}"))
    missing = [f for f in names.values() if f.name not in kwargs and no_default(f)]
    if missing and not values:
        return None, [Problem(group, f"the {group} group is missing: choose one, e.g. "
                                     f"{group}=<preset> (python -m hpctrain --help)")]
    problems += [Problem(f"{group}.{f.name}", f"{group}.{f.name} is missing: set "
                         f"{group}.{f.name}=<{_type_name(hints[f.name])}>")
                 for f in missing if f.name not in values]
    return (None if missing else cls(**kwargs)), problems


# Keys that were renamed or replaced → what to set instead.
REPLACED = {
    "train.eval_batches": "train.eval_batches (per dp rank, so the eval set grew with dp) was "
                          "replaced by train.eval_samples, a fixed number of validation samples "
                          "split over the dp ranks: e.g. train.eval_samples=16 for the old "
                          "train.eval_batches=4 with train.micro_batch_size=4 at dp=1",
}


def config_key(field_name: str) -> str:
    """The key of a dataclass field: its name, but `from_` is the key `from` (a field cannot
    be named after a Python keyword)."""
    bare = field_name.removesuffix("_")
    return bare if bare != field_name and keyword.iskeyword(bare) else field_name


def unknown_key(group: str, key: str, names: list[str]) -> Problem:
    if f"{group}.{key}" in REPLACED:
        return Problem(f"{group}.{key}", REPLACED[f"{group}.{key}"])
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" Did you mean {group}.{close[0]}?" if close else ""
    return Problem(f"{group}.{key}",
                   f"unknown key {group}.{key}; valid keys: {', '.join(names)}.{hint}")


def no_default(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


_KINDS = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}


def _example(group: str, f: dataclasses.Field, hint: Any) -> str:
    """The fix for a mistyped value: the default as an example, or the kind of value to give."""
    if f.default not in (dataclasses.MISSING, None) and not isinstance(f.default, tuple):
        return f": e.g. {group}.{f.name}={f.default} (the default)"
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    base = next(a for a in args if a is not type(None)) if optional else hint
    if typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]
        return f": give a list whose items are each {_KINDS.get(item, _type_name(item))}"
    return f": give {_KINDS.get(base, _type_name(base))}" + (" or null" if optional else "")


def _type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return getattr(args[0], "__name__", str(args[0]))


class ChoiceError(ValueError):
    """A value outside its field's `Literal[...]` choices; the message names them."""


def literal_choices(hint: Any) -> tuple | None:
    """The allowed values of a `Literal[...]` field (also inside `X | None`), else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def choice_text(key: str, value: Any, allowed: tuple) -> str:
    """"<key>=<value> is not one of <allowed>: did you mean <closest>?" (or an example)."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    fix = f"did you mean {key}={close[0]}?" if close else f"e.g. {key}={allowed[0]}"
    return f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}: {fix}"


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check a value against its field's type; lists become tuples, ints become floats, a
    `Literal` field takes only its listed values (ChoiceError otherwise)."""
    allowed = literal_choices(hint)
    if allowed is not None and not (value is None and type(None) in typing.get_args(hint)):
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise ChoiceError(choice_text(key, value, allowed))
    base = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        base = next(a for a in args if a is not type(None))
    origin = typing.get_origin(base) or base
    if origin is tuple and isinstance(value, list | tuple):
        item = typing.get_args(base)[0] if typing.get_args(base) else Any
        if item is Any:
            return tuple(value)
        return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if origin is dict and isinstance(value, dict):
        return value
    if dataclasses.is_dataclass(origin) and isinstance(value, dict):  # a nested group: model.moe
        built, problems = build_checked(origin, key, value)
        if problems:
            raise ValueError("; ".join(p.text for p in problems))
        return built
    if origin is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if origin is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if origin in (str, bool) and isinstance(value, origin):
        return value
    raise ValueError(f"{key}={value!r} should be {getattr(origin, '__name__', origin)}")

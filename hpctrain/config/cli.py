"""What `python -m hpctrain` shows a person about its configuration: `<group> --help` from the
schema, and Hydra's own composition errors as hpctrain's one message.

Everything here returns text; hpctrain.__main__ writes it (a task's results: its entry in
hpctrain.tasks).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import typing
from pathlib import Path
from typing import Any

from hydra.errors import MissingConfigException, OverrideParseException

from hpctrain.config.build import Problem, config_key, format_problems, type_hints, unknown_key
from hpctrain.config.generate import GENERATE_RANGES
from hpctrain.config.hydra_schema import SCHEMAS
from hpctrain.config.validate.keys import RANGES

CONF = Path(__file__).resolve().parents[2] / "conf"
_FIELD = re.compile(r"^    (\w+): [^#]*?(?:#\s*(.*))?$")


def field_comments(cls: type) -> dict[str, str]:
    """Field → its meaning: the comment above the field (joined) and the one after it."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out, above = {}, []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        m = _FIELD.match(line)
        if m:
            out[m.group(1)] = " ".join([*above, m.group(2) or ""]).strip()
        above = []
    return out


def _choices(hint: Any) -> tuple | None:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return args
    for a in args:  # Optional[Literal[...]]
        if typing.get_origin(a) is typing.Literal:
            return typing.get_args(a)
    return None


def _yaml(v: Any) -> str:
    if v is None:
        return "null"
    return str(v).lower() if isinstance(v, bool) else str(v)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return str(f.default_factory())
    return "(set by the preset)"


def group_help(name: str) -> str | None:
    """`python -m hpctrain <group> --help` (or `<group>.<key> --help`, nested keys such as
    `model.moe` included): each key's meaning, default, choices and range from the schema, and
    the group's presets; None for no such group or key."""
    group, _, key = name.partition(".")
    cls = SCHEMAS.get(group)
    if cls is None:
        return None
    rows = _key_rows(group, cls, key)
    if not rows:
        return None
    lines = [f"{group}: {(cls.__doc__ or '').strip().splitlines()[0]}"
             if cls.__doc__ and not cls.__doc__.startswith(cls.__name__) else f"{group}:"]
    lines += rows
    presets = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    if presets and not key:
        lines.append(f"presets: {group}={' | '.join(presets)}")
    return "\n".join(lines)


def _key_rows(prefix: str, cls: type, key: str) -> list[str]:
    """The help lines of `cls`'s keys under `prefix` (only `key` and what lies under it when
    given), nested dataclasses expanded key by key."""
    hints, notes = type_hints(cls), field_comments(cls)
    head, _, rest = key.partition(".")
    lines = []
    for f in dataclasses.fields(cls):
        if head and config_key(f.name) != head:
            continue
        full = f"{prefix}.{config_key(f.name)}"  # export.from, not from_
        if dataclasses.is_dataclass(hints[f.name]):
            lines += _key_rows(full, hints[f.name], rest)
            continue
        if rest:
            continue
        choices, rule = _choices(hints[f.name]), RANGES.get(full) or GENERATE_RANGES.get(full)
        lines.append(f"  {full} = {_default(f)}"
                     + (f"   choices: {' | '.join(map(_yaml, choices))}" if choices else "")
                     + (f"   range: {rule.describe()}" if rule else ""))
        if notes.get(f.name):
            lines.append(f"      {notes[f.name]}")
    return lines


def hydra_error_message(err: BaseException) -> str | None:
    """A Hydra composition error (a misspelled option or key, a bad override) as hpctrain's
    one message with the fix; None for anything else (a bug: its traceback is shown)."""
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.partition("/")
        options = list(err.options or [])
        close = difflib.get_close_matches(option, options, n=1)
        fix = f"did you mean {group}={close[0]}? " if close else ""
        return format_problems([f"{group}={option}: no such {group} option; {fix}(options: "
                                f"{', '.join(options)}; python -m hpctrain {group} --help)"])
    text = str(err)
    m = re.match(r"Could not override '([\w.]+)'", text)
    if m:
        return format_problems([_unknown_key(m.group(1))])
    if isinstance(err, OverrideParseException):
        return format_problems([f"cannot read the override {err.override!r}: {err.message}"])
    if type(err).__module__.startswith("hydra"):
        cause = f" ({err.__cause__})" if err.__cause__ else ""
        return format_problems([f"{text.strip()}{cause}"])
    return None


def _unknown_key(dotted: str) -> Problem | str:
    group, _, key = dotted.partition(".")
    cls = SCHEMAS.get(group)
    if cls is None or not key or "." in key:
        return f"unknown key {dotted}: python -m hpctrain --help lists the groups"
    names = [f.name for f in dataclasses.fields(cls)]
    return unknown_key(group, key, names)

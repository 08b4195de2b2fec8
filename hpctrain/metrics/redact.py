"""Secrets never leave the process in clear: configs, logs and W&B see `***` instead.

A value is secret when its name matches `SECRET_NAME` (…KEY, …TOKEN, …SECRET, …PASSWORD, any
case): environment variables such as WANDB_API_KEY or HF_TOKEN, and entries of `cluster.env`.
`redact` rewrites nested containers by key; `SecretFilter` scrubs the values themselves from
every log record, wherever they appear in the message.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)", re.IGNORECASE)
MASK = "***"
_MIN_LEN = 4  # shorter values ("1", "true") would scrub ordinary words from messages


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def redact(value: Any) -> Any:
    """A copy of `value` with every entry under a secret-looking key replaced by MASK.
    Lists and tuples are walked; an `override` string `a.b.SOME_KEY=v` is masked too."""
    if isinstance(value, Mapping):
        return {k: (MASK if is_secret(k) and v not in (None, "") else redact(v))
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str) and "=" in value:
        key, _, rest = value.partition("=")
        if is_secret(key.rsplit(".", 1)[-1]) and rest:
            return f"{key}={MASK}"
    return value


def secret_values(*extra: Mapping[str, Any]) -> set[str]:
    """Values of secret-named environment variables and of secret-named entries in `extra`."""
    found = {v for k, v in os.environ.items() if is_secret(k)}
    for mapping in extra:
        found |= {str(v) for k, v in mapping.items() if is_secret(k) and v is not None}
    return {v for v in found if len(v) >= _MIN_LEN}


class SecretFilter(logging.Filter):
    """Replaces known secret values in a record's final message with MASK."""

    def __init__(self, values: Iterable[str]):
        super().__init__()
        self.values = sorted(set(values), key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.values:
            return True
        message = record.getMessage()
        scrubbed = message
        for value in self.values:
            scrubbed = scrubbed.replace(value, MASK)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        return True


def install_log_filter(*extra: Mapping[str, Any]) -> None:
    """Attach a SecretFilter to every handler of the root logger (handlers see records from
    every logger; a filter on a logger would miss its children)."""
    flt = SecretFilter(secret_values(*extra))
    for handler in logging.getLogger().handlers:
        handler.filters = [f for f in handler.filters if not isinstance(f, SecretFilter)]
        handler.addFilter(flt)


def redact_yaml_files(paths: Iterable[Path], *, attempts: int = 30) -> None:
    """Rewrite YAML files (Hydra's `.hydra/config.yaml`, `overrides.yaml`, `hydra.yaml`) with
    secret-named entries and `key=value` overrides masked. Missing files are skipped.

    In a Slurm job every task's Hydra writes these files (not atomically) and then redacts
    them, so a file may be caught half-written: it is read again until it parses (up to
    `attempts` × 0.1 s), and rewritten atomically (temp file + rename), so a reader never sees
    half of it and the last writer of the job is always a redaction. A file that never parses
    is left alone with a warning: redaction must not kill the run."""
    for path in paths:
        data = _read_yaml(path, attempts=attempts)
        if data is None:
            continue
        clean = redact(data)
        if clean != data:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(yaml.safe_dump(clean, sort_keys=False))
            os.replace(tmp, path)


def _read_yaml(path: Path, *, attempts: int) -> Any:
    for _ in range(attempts):
        if not path.is_file():
            return None
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            data = None
        if data is not None:
            return data
        time.sleep(0.1)  # being written by another task's Hydra
    logging.getLogger(__name__).warning("%s did not parse as YAML: left unredacted", path)
    return None

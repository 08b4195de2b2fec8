"""Secrets never leave the process in clear: configs, logs, summaries and W&B see `***`.

A name is a credential's when one of its parts (split at `_`, `-`, `.` and lower→upper case
changes) is, or ends with, one of CREDENTIAL_WORDS (KEY, TOKEN, SECRET, PASSWORD, PASSWD, AUTH,
CREDENTIAL(S), PRIVATE: WANDB_API_KEY, HF_AUTH, DB_PASSWD, GhToken), or is PAT (a personal
access token: GITHUB_PAT), or is listed in `logger.redact`. Names of the environment that hold
paths are not (PWD, OLDPWD, SSH_AUTH_SOCK, XAUTHORITY, ...). `Secrets` holds the values of such
names in the environment and in `cluster.env`, and masks them by value wherever they appear: a
log record, a YAML or JSON document, a string. A value that is a path is never a secret (the
working and run directories stay readable), nor is one shorter than MIN_LEN characters (it
would scrub ordinary words). `cluster.env` entries and `cluster.env.NAME=value` overrides with
a credential's name are masked by name as well, whatever their length. The password of a URL
(`scheme://user:password@host`, as in DATABASE_URL) is masked wherever a URL appears, whatever
its name and length.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

CREDENTIAL_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASS", "PWD", "AUTH",
                    "CREDENTIAL", "CREDENTIALS", "PRIVATE")
# Environment names with a credential word that hold paths or sockets, not secrets.
NOT_SECRET = frozenset({"PWD", "OLDPWD", "SSH_AUTH_SOCK", "XAUTHORITY", "KRB5CCNAME",
                        "GPG_AGENT_INFO", "SSH_AGENT_PID"})
EXACT_WORDS = ("PAT",)  # credential parts too short to match as endings (COMPAT, SPAT)
MASK = "***"
MIN_LEN = 6
ENV_MAPPINGS = ("env", "env_set")  # cluster.env, Hydra's hydra.job.env_set: masked by name
_PARTS = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)([^@\s/]+)(@)")
_OVERRIDE = re.compile(r"^(\+{0,2}(?:[\w.]+\.)?env\.)([\w.-]+)=(.+)$")


def name_parts(name: str) -> list[str]:
    return [p.upper() for p in _PARTS.split(str(name)) if p]


def is_secret(name: str, listed: Iterable[str] = ()) -> bool:
    """Whether `name` is a credential's (module docstring); `listed`: logger.redact."""
    upper = str(name).upper()
    if upper in {n.upper() for n in listed}:
        return True
    if upper in NOT_SECRET:
        return False
    return any(p.endswith(CREDENTIAL_WORDS) or p in EXACT_WORDS for p in name_parts(name))


def _is_path(value: str) -> bool:
    """A path that exists (a credential file's location, a socket): never a secret itself. A
    value that only looks like one (a base64 key may start with "/") is still masked."""
    try:
        return os.sep in value and os.path.exists(os.path.expanduser(value))
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Secrets:
    """The secret values of this run and the names that mark them (module docstring)."""

    values: tuple[str, ...] = ()  # longest first, so a value inside another is masked whole
    listed: tuple[str, ...] = ()  # logger.redact

    @classmethod
    def of(cls, cluster_env: Mapping[str, Any] | None = None, listed: Iterable[str] = (), *,
           environ: Mapping[str, str] | None = None) -> Secrets:
        listed = tuple(str(n) for n in listed)
        env = os.environ if environ is None else environ
        found = {str(v) for mapping in (env, cluster_env or {}) for k, v in mapping.items()
                 if v is not None and is_secret(k, listed)}
        kept = {v for v in found if len(v) >= MIN_LEN and not _is_path(v)}
        return cls(tuple(sorted(kept, key=len, reverse=True)), listed)

    def text(self, text: str) -> str:
        for value in self.values:
            text = text.replace(value, MASK)
        return _URL_PASSWORD.sub(rf"\1{MASK}\3", text)

    def data(self, value: Any, *, key: str | None = None) -> Any:
        """A copy of `value` (mappings, lists, tuples, strings) with every secret value masked,
        the credential-named entries of an `env` mapping (cluster.env) and `...env.NAME=v`
        override strings masked whole."""
        if isinstance(value, Mapping):
            env = key in ENV_MAPPINGS
            return {k: (MASK if env and is_secret(k, self.listed) and v not in (None, "")
                        else self.data(v, key=str(k))) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.data(v) for v in value)
        if isinstance(value, str):  # also Hydra's override_dirname: overrides joined by ","
            return self.text(",".join(self._override(part) for part in value.split(",")))
        return value

    def _override(self, text: str) -> str:
        m = _OVERRIDE.match(text)
        if m and is_secret(m.group(2), self.listed):
            return f"{m.group(1)}{m.group(2)}={MASK}"
        return text


class SecretFilter(logging.Filter):
    """Replaces known secret values in a record's final message with MASK."""

    def __init__(self, secrets: Secrets):
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        scrubbed = self.secrets.text(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        return True


def install_log_filter(secrets: Secrets) -> None:
    """Attach a SecretFilter to every handler of the root logger (handlers see records from
    every logger; a filter on a logger would miss its children)."""
    flt = SecretFilter(secrets)
    for handler in logging.getLogger().handlers:
        handler.filters = [f for f in handler.filters if not isinstance(f, SecretFilter)]
        handler.addFilter(flt)

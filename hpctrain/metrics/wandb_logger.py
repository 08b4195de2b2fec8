"""Weights & Biases on the logging rank only: one W&B run per job, never one per GPU.

Mode `auto` is online when an API key is configured (WANDB_API_KEY or a netrc entry) and
offline otherwise (air-gapped clusters); `offline` files can be synced later with
`wandb sync`. The run id is kept in `<run_dir>/wandb_id.txt`, so a resumed or requeued job
continues the same W&B run.

Logging never kills a run: before going online the server is probed (a TCP connect bounded by
`PROBE_S`), and a server that cannot be reached, a rejected key or any other failure of
`wandb.init` degrades to offline with one warning. The config W&B receives is redacted
(hpctrain.metrics.redact): no secret value reaches the server.
"""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
import secrets
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hpctrain.config.schema import LoggerConfig
from hpctrain.metrics.redact import Secrets

log = logging.getLogger(__name__)


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str) -> str:
    if mode == "auto":
        return "online" if _has_api_key() else "offline"
    return mode


def run_id(run_dir: Path) -> str:
    """The W&B id of this run directory, created once and reused on resume."""
    path = run_dir / "wandb_id.txt"
    if path.exists():
        return path.read_text().strip()
    rid = secrets.token_hex(4)  # 8 lowercase hex chars: a valid W&B run id
    path.write_text(rid + "\n")
    return rid


PROBE_S = 5.0  # how long the reachability probe may take before W&B goes offline
INIT_TIMEOUT_S = 30.0  # wandb.init's own limit once the server answered the probe


def server_reachable(base_url: str, *, timeout_s: float = PROBE_S) -> bool:
    """True when a TCP connection to the W&B server opens within `timeout_s` (name lookup
    included: it runs in a daemon thread, so a stalled resolver cannot hold the run)."""
    parts = urlsplit(base_url)
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not host:
        return False
    ok = threading.Event()

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            ok.set()
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return ok.is_set()


class WandbLogger:
    def __init__(self, cfg: LoggerConfig, *, run_dir: Path, config: dict[str, Any],
                 secrets: Secrets):
        import wandb  # heavy (~1 s to import): only when logger.wandb is not disabled

        self.secrets = secrets

        self.mode = resolve_mode(cfg.wandb)
        base_url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
        if self.mode == "online" and not server_reachable(base_url):
            log.warning("W&B server %s is unreachable: logging offline (sync later with "
                        "`wandb sync %s`)", base_url, run_dir / "wandb")
            self.mode = "offline"
        names = secrets.data(dict(project=cfg.project, entity=cfg.entity, group=cfg.group,
                                  name=cfg.run_name))
        kwargs = dict(**names, id=run_id(run_dir), resume="allow", dir=str(run_dir),
                      config=secrets.data(config), settings=_settings(wandb))
        self.run = _init(wandb, self.mode, kwargs)
        if self.run is None and self.mode != "offline":
            self.mode = "offline"
            self.run = _init(wandb, self.mode, kwargs)
        if self.run is None:
            log.warning("W&B is unavailable: this run logs to metrics.jsonl only")
            return
        log.info("W&B run %s (%s) in %s", self.run.id, self.mode, self.run.dir)

    def _guarded(self, what: str, fn) -> None:
        """W&B is best effort: Slurm's SIGTERM (preemption) also reaches the wandb-core service
        process, and a lost service must not kill the rank in the middle of its stop
        checkpoint. After one failure this run logs to JSONL only."""
        if self.run is None:
            return
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - W&B is best effort
            log.warning("W&B %s failed (%s): continuing without W&B", what, err)
            self.run = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = {k: v for k, v in metrics.items() if v is not None}
        self._guarded("log", lambda: self.run.log(values, step=step))

    def summary(self, values: dict[str, Any]) -> None:
        def update():
            for k, v in values.items():
                if isinstance(v, int | float | str) and v is not None:
                    self.run.summary[k] = self.secrets.data(v)

        self._guarded("summary", update)

    def alert(self, title: str, text: str) -> None:
        """A W&B alert (offline runs have none: their metrics say it); its failure is logged
        and leaves the run logging."""
        if self.run is None or self.run.settings.mode == "offline":
            return
        try:
            self.run.alert(title=title, text=self.secrets.data(text))
        except Exception as err:  # noqa: BLE001 - W&B is best effort
            log.warning("W&B alert failed (%s)", err)

    def close(self) -> None:
        self._guarded("finish", lambda: self.run.finish())


def _settings(wandb):
    """No console capture or system stats; no metadata either: it records the command line,
    where `cluster.env.SOME_TOKEN=...` overrides would reach the server in clear."""
    return wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True,
                          init_timeout=INIT_TIMEOUT_S)


def _init(wandb, mode: str, kwargs: dict[str, Any]):
    """wandb.init, or None (with a warning naming the error) when it fails."""
    try:
        return wandb.init(mode=mode, **kwargs)
    except Exception as err:  # noqa: BLE001 - any W&B failure must degrade, never kill the run
        log.warning("W&B %s init failed (%s: %s)%s", mode, type(err).__name__, err,
                    ": logging offline instead" if mode != "offline" else "")
        with contextlib.suppress(Exception):  # free the half-made run's id for the retry
            wandb.teardown()
        return None

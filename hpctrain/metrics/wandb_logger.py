"""Weights & Biases on the logging rank only: one W&B run per job, never one per GPU.

Mode `auto` is online when an API key is configured (WANDB_API_KEY or a netrc entry) and
offline otherwise (air-gapped clusters); `offline` files can be synced later with
`wandb sync`. The run id is kept in `<run_dir>/wandb_id.txt`, so a resumed or requeued job
continues the same W&B run.
"""

from __future__ import annotations

import logging
import netrc
import os
import secrets
from pathlib import Path
from typing import Any

from hpctrain.config import LoggerConfig

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


class WandbLogger:
    def __init__(self, cfg: LoggerConfig, *, run_dir: Path, config: dict[str, Any]):
        import wandb

        self.mode = resolve_mode(cfg.wandb)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, group=cfg.group, name=cfg.run_name,
            id=run_id(run_dir), resume="allow", dir=str(run_dir), mode=self.mode,
            config=config, settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        log.info("W&B run %s (%s) in %s", self.run.id, self.mode, self.run.dir)

    def _guarded(self, what: str, fn) -> None:
        """W&B is best effort: Slurm's SIGTERM (preemption) also reaches the wandb-core service
        process, and a lost service must not kill the rank in the middle of its stop
        checkpoint. After one failure this run logs to JSONL only."""
        if self.run is None:
            return
        try:
            fn()
        except (ConnectionError, OSError) as err:
            log.warning("W&B %s failed (%s): continuing without W&B", what, err)
            self.run = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = {k: v for k, v in metrics.items() if v is not None}
        self._guarded("log", lambda: self.run.log(values, step=step))

    def summary(self, values: dict[str, Any]) -> None:
        def update():
            for k, v in values.items():
                if isinstance(v, int | float | str) and v is not None:
                    self.run.summary[k] = v

        self._guarded("summary", update)

    def close(self) -> None:
        self._guarded("finish", lambda: self.run.finish())

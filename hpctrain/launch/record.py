"""The run directory's record of how the run was started, written by the run that owns it.

Hydra would write `.hydra/config.yaml`, `overrides.yaml` and `hydra.yaml` as it starts, before
hpctrain has checked anything or taken the directory's lock (`launch.rundir_lock`): a second
run refused on a busy directory would already have replaced the live run's record. So Hydra
writes nothing there (`hydra.output_subdir: null`); `hydra_record` renders the same three
files (secrets masked, `metrics.redact`) in the entry point, and `write_record` puts them in
place once the lock is held (Slurm task 0 only), each file atomically. The launcher's own log
lines join `<run_dir>/hpctrain.log` from that moment too (`log_to_run_dir`).

Readers: the sweep summary (`overrides.yaml`), `task=export` (the tokenizer path),
`task=plan plan.calibrate_from` (the achievable fraction).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

from hpctrain.errors import OnceFileHandler
from hpctrain.metrics.redact import SecretFilter, Secrets

RECORD_DIR = ".hydra"
LOG_NAME = "hpctrain.log"
LOG_FORMAT = "[%(asctime)s %(name)s %(levelname)s] %(message)s"


def hydra_record(task_cfg, secrets: Secrets) -> dict[str, str]:
    """file name → text of the record of this Hydra job: its composed config, its command-line
    overrides and Hydra's own config, as Hydra would save them, with `secrets` masked."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra_cfg = HydraConfig.get()
    docs = {"config.yaml": OmegaConf.to_container(task_cfg, resolve=False, enum_to_str=True),
            "overrides.yaml": list(hydra_cfg.overrides.task),
            "hydra.yaml": {"hydra": OmegaConf.to_container(hydra_cfg, resolve=False,
                                                          enum_to_str=True)}}
    return {name: yaml.safe_dump(secrets.data(doc), sort_keys=False)
            for name, doc in docs.items()}


@contextlib.contextmanager
def recorded(run_dir: str | os.PathLike, files: Mapping[str, str]):
    """Write `files` as the run's record for the span of the run; a run refused inside it
    (ValueError: a checkpoint of another model or seed, a busy directory) puts the record it
    replaced back, so a refused run leaves nothing of itself in another run's record."""
    out = Path(run_dir) / RECORD_DIR
    before = {name: (out / name).read_text() for name in files if (out / name).is_file()}
    write_record(run_dir, files)
    try:
        yield
    except ValueError:
        write_record(run_dir, before)
        for name in set(files) - set(before):
            (out / name).unlink(missing_ok=True)
        raise


def write_record(run_dir: str | os.PathLike, files: Mapping[str, str]) -> None:
    """Write `files` into `<run_dir>/.hydra/`, each one whole or not at all."""
    if not files:
        return
    out = Path(run_dir) / RECORD_DIR
    out.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    for name, text in files.items():
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
        os.fchmod(fd, 0o666 & ~umask)  # as any file the run writes (mkstemp makes it 0600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out / name)


def log_to_run_dir(run_dir: str | os.PathLike, secrets: Secrets) -> logging.Handler:
    """Append this process's log records to `<run_dir>/hpctrain.log` (secrets masked); the
    caller removes the returned handler when the run ends."""
    handler = OnceFileHandler(Path(run_dir) / LOG_NAME, mode="a")
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(SecretFilter(secrets))
    logging.getLogger().addHandler(handler)
    return handler

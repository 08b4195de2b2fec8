"""`python -m hpctrain [overrides]`: compose the config, validate it, dispatch on task."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hpctrain import dispatch
from hpctrain.config import cli, hydra_schema
from hpctrain.errors import RunStopped, end_process, path_stop, storage_stop
from hpctrain.launch import resolvers
from hpctrain.launch.record import hydra_record
from hpctrain.metrics.redact import Secrets, install_log_filter
from hpctrain.tasks.configure import parse

log = logging.getLogger("hpctrain")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict | None:
    # Also here, not only below: a submitit job unpickles this function and resolves `cfg`
    # (cluster.nodes=${hpctrain.nodes:...}) without running this module's __main__ block.
    resolvers.register()
    secrets = Secrets.of(cfg.get("cluster", {}).get("env") or {},
                         cfg.get("logger", {}).get("redact") or ())
    install_log_filter(secrets)
    try:  # every user mistake ends here: one message, exit 2, no rank started
        record = hydra_record(cfg, secrets)  # written by the run once it owns the directory
        parsed = parse(cfg)
        with _storage_errors(parsed.data.cache_dir):
            dispatch.preflight(parsed)
    except ValueError as err:
        log.error("%s", err)
        if _in_sweep():
            raise  # a failed point of a sweep (maybe a Slurm job): Hydra reports it, others go on
        sys.exit(2)
    except RunStopped as err:  # the data cache cannot be written
        log.error("%s", err)
        if _in_sweep():
            raise
        sys.exit(err.exit_code)
    try:
        with _storage_errors(parsed.run_dir):
            result = dispatch.launch(parsed, record=record)
        shown = dispatch.format_result(parsed.task, result)
        if shown:  # results last, on stdout (logs are on stderr)
            print(shown, flush=True)
        return result
    except (RunStopped, ValueError) as err:  # one message and its exit code, no traceback
        # ValueError: a refusal found once the run started (the run directory is busy, the
        # checkpoint to resume is damaged or of another model); RunStopped: the ranks agreed
        # to stop (a signal, a non-finite step, a failed rank), or the disk refused a write.
        log.error("%s", err)
        if _in_sweep():
            raise
        code = err.exit_code if isinstance(err, RunStopped) else 2
    end_process(code)


@contextlib.contextmanager
def _storage_errors(where: str):
    """A write the storage refused (full, read-only) or a path that cannot be a directory (a
    file or a broken symlink in the way) becomes one message (errors.storage_stop, naming
    `where` when the error names no file; errors.path_stop); other OSErrors keep their
    traceback."""
    try:
        yield
    except OSError as err:
        stop = storage_stop(err, where=where) or path_stop(err)
        if stop is None:
            raise
        raise stop from err


def _in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _group_help(argv: list[str]) -> str | None:
    """`python -m hpctrain <group>[.<key>] --help`: that group's keys from the schema."""
    if not {"--help", "-h"} & set(argv):
        return None
    named = [a for a in argv if not a.startswith("-") and "=" not in a]
    return cli.group_help(named[0]) if len(named) == 1 else None


def _entry() -> None:
    """Hydra's own errors (a misspelled option or key) are raised to here, not printed by
    Hydra, and end as hpctrain's one message with exit 2; HYDRA_FULL_ERROR=1 set by the user
    keeps Hydra's full report."""
    text = _group_help(sys.argv[1:])
    if text is not None:
        print(text)
        return
    users_full_error = "HYDRA_FULL_ERROR" in os.environ
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises instead of printing and exit 1
    try:
        main()
    except (RunStopped, ValueError):  # a failed sweep point, already logged by main
        if users_full_error:
            raise
        sys.exit(1)
    except Exception as err:
        # Hydra could not create the run directory (read-only, full): one message. (Hydra's
        # MissingConfigException is an OSError too, without an errno: the branch below.)
        stop = (storage_stop(err) or path_stop(err)) if isinstance(err, OSError) else None
        if stop is not None and not users_full_error:
            print(f"error: {stop}", file=sys.stderr)
            sys.exit(stop.exit_code)
        message = None if users_full_error else cli.hydra_error_message(err)
        if message is None:
            raise
        print(message, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    # Where Hydra is entered, not on `import hpctrain`: no process-wide side effects on import.
    hydra_schema.register()  # every group's keys and defaults, from the dataclasses
    resolvers.register()  # ${hpctrain.nodes:...} & co. in conf/cluster/slurm.yaml
    _entry()

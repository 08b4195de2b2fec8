"""`python -m hpctrain [overrides]`: compose the config, validate it, dispatch on task."""

from __future__ import annotations

import gc
import logging
import sys

import hydra
from omegaconf import DictConfig

from hpctrain import config, tasks
from hpctrain.errors import RunStopped

log = logging.getLogger("hpctrain")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict | None:
    try:
        parsed = config.parse(cfg)
    except ValueError as err:
        log.error("%s", err)
        if _in_sweep():
            raise  # a failed point of a sweep (maybe a Slurm job): Hydra reports it, others go on
        sys.exit(2)
    try:
        return tasks.run(parsed)
    except RunStopped as err:  # the ranks agreed to stop: one message and its exit code
        log.error("%s", err)
        if _in_sweep():
            raise
        code = err.exit_code
    # Out of the except block, with the traceback's frames collected: the rank's objects
    # (process groups and their threads) go now, not during interpreter shutdown.
    gc.collect()
    sys.exit(code)


def _in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


if __name__ == "__main__":
    main()

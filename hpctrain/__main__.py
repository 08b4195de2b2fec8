"""`python -m hpctrain [overrides]`: compose the config, validate it, dispatch on task."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from hpctrain import config, tasks

log = logging.getLogger("hpctrain")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict | None:
    try:
        parsed = config.parse(cfg)
    except ValueError as err:
        log.error("%s", err)
        sys.exit(2)
    return tasks.run(parsed)


if __name__ == "__main__":
    main()

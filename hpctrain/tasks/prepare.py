"""task=prepare: tokenise the data into the cache (hpctrain.data.prepare), once, with no ranks.
In a Slurm job the job's tasks share the work (each its units; task 0 assembles)."""

from __future__ import annotations

import json
import os
from typing import Any

from hpctrain.config.schema import Config
from hpctrain.data.prepare import prepare


def run_prepare(cfg: Config) -> dict[str, Any]:
    """The prepared directory and its meta.json."""
    share = (0, 1)
    if cfg.cluster.launcher == "slurm" and "SLURM_PROCID" in os.environ:
        share = (int(os.environ["SLURM_PROCID"]), int(os.environ.get("SLURM_NTASKS", "1")))
    out = prepare(cfg.data, share=share, timeout_s=cfg.cluster.timeout_s)
    return {"data_dir": str(out), **json.loads((out / "meta.json").read_text())}

"""task=train on every rank: the trainer, with the ranks' agreed stop check and the planner's
prediction of what the run will hold and take."""

from __future__ import annotations

import functools
from typing import Any

from hpctrain.config.schema import Config
from hpctrain.distributed import preempt
from hpctrain.distributed.mesh import Mesh
from hpctrain.plan.predict import RunPrediction
from hpctrain.train.trainer import Trainer


def run_train(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    prediction = RunPrediction(cfg, device=mesh.device, logging_rank=mesh.is_logging_rank)
    stop = functools.partial(preempt.stop_agreed, group=mesh.world, device=mesh.device)
    return Trainer(cfg, mesh, stop_requested=stop, prediction=prediction).run()

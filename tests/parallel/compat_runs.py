"""What a rank of tests/parallel/test_compat_matrix.py runs, in a module of its own: a rank
unpickles the function by importing its module, and the test module computes the matrix's
covering runs at import (about 20 s of one core, once per rank otherwise)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import build_mesh
from hpctrain.train.trainer import Trainer


def trajectory(cfg, compiled: bool):
    """(loss, grad norm) per step of training `cfg` on this rank, and the compile watch's
    summary when `compiled`."""
    if compiled:  # a clean dynamo per run: graphs of earlier runs neither help nor count
        torch._dynamo.reset()
    mesh = build_mesh(cfg.parallel.dims, rank=dist.get_rank(), device=torch.device("cpu"))
    trainer = Trainer(cfg, mesh)
    trainer.run()
    got = [(h["loss"], h["grad_norm"]) for h in trainer.history]
    return got, trainer.compile_watch.summary() if compiled else None

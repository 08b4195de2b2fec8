"""`bench=train`: a few steps through the real trainer; its own summary gives the numbers.

Steps = bench.warmup + bench.iters (the trainer's summary already takes the median over the
steps after the first two); no evaluation, no resume. tokens/s is global, as the trainer logs it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hpctrain.bench.timing import node_name, stem
from hpctrain.config.bench import BenchConfig
from hpctrain.config.schema import Config
from hpctrain.distributed.mesh import Mesh
from hpctrain.train.trainer import Trainer

SUMMARY_KEYS = ("tokens_per_s", "mfu", "step_time_s", "peak_memory_bytes", "final_loss",
                "device", "world_size", "completed_steps", "metrics")


def run_train(b: BenchConfig, mesh: Mesh, cfg: Config) -> list[dict[str, Any]]:
    t = replace(cfg.train, steps=b.warmup + b.iters, eval_every=0, checkpoint_every=0,
                resume="never", stop_after=None)
    summary = Trainer(replace(cfg, train=t), mesh).run()
    if not summary:  # only the trainer's logging rank returns its summary
        return []
    return [stem("train", rank=mesh.rank, node=node_name(), model=cfg.model.name,
                 precision=t.precision, **{k: summary.get(k) for k in SUMMARY_KEYS})]

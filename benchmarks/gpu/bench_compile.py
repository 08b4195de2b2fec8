"""The `compile` section of benchmarks/gpu/run.sh: eager bf16 vs train.compile=blocks bf16.

A ~1B Llama (model=llama3_1b, L = 4096, 4 rows, sdpa) trained --steps steps by hpctrain's own
Trainer on one GPU, eager and with each block compiled: the median tokens/s, MFU and step time
after --skip warm-up steps (the first step compiles), the compile time and graphs from
hpctrain.models.compile, and the speed-up of compiled over eager (goal: ≥ 1.15×).
--dry-run: CPU, model=debug, to keep the section working without a GPU.
"""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile

import torch

GOAL = 1.15  # compiled tokens/s over eager, issue 16


def init_single_process(device: torch.device) -> None:
    """A one-rank process group (the Trainer's mesh needs one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.FileStore(tempfile.mktemp(prefix="hpctrain-bench-"), 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=300))


def measure_trainer(overrides: list[str], device: torch.device, *, steps: int,
                    skip: int) -> dict:
    """Median mfu, tokens/s and step time of `steps` Trainer steps after `skip`, plus the
    compile accounting (hpctrain.models.compile.CompileWatch)."""
    from hpctrain.distributed.dims import ParallelDims
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.train.trainer import Trainer
    from tests.conftest import make_config

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = make_config(overrides, run_dir=run_dir)
        trainer = Trainer(cfg, build_mesh(ParallelDims(), rank=0, device=device))
        records = []
        for _ in range(steps):
            with trainer.compile_watch.step():
                records.append(trainer.train_one())
        compiled = trainer.compile_watch.summary()
        del trainer
    kept = records[skip:]
    row = {k: statistics.median(r[k] for r in kept) if kept[0][k] is not None else None
           for k in ("mfu", "tokens_per_s", "step_time_s")}
    return row | compiled


def model_overrides(dry_run: bool, device: torch.device) -> list[str]:
    """The trained model of the mfu, fp8 and compile sections: a ~1B Llama at L = 4096, 4 rows
    (the debug model at L = 32 on a CPU dry run); one process, no W&B, no eval, no resume."""
    if dry_run:
        size = ["model=debug", "train=debug", "train.seq_len=32", "train.global_batch_size=2",
                "data.max_bytes=200000"]
    else:
        size = ["model=llama3_1b", "train.seq_len=4096", "train.micro_batch_size=4",
                "train.global_batch_size=4", "data.max_bytes=8000000"]
    return size + [f"cluster.device={device.type}", "logger.wandb=disabled",
                   "train.eval_every=0", "train.resume=never"]


def section_compile(args, device) -> list[dict]:
    # bf16 on the dry run too: its blocks are then the fp8 section's bf16 ones, which inductor's
    # graph cache holds (one CPU compile less, ~15 s cold on 2 cores)
    over = model_overrides(args.dry_run, device) + ["model.attention=sdpa", "train.precision=bf16"]
    init_single_process(device)
    rows = []
    for mode in ("none", "blocks"):
        row = {"compile": mode}
        try:
            row |= measure_trainer([*over, f"train.compile={mode}"], device,
                                   steps=args.steps, skip=args.skip)
        except Exception as e:  # noqa: BLE001 - a failing variant is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    eager, compiled = (r.get("tokens_per_s") for r in rows)
    if eager and compiled:
        rows[1]["speedup"] = compiled / eager
        rows[1]["goal"] = f"≥ {GOAL}× eager: {'met' if compiled / eager >= GOAL else 'missed'}"
    return rows

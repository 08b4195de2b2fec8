"""Sharded checkpoints: memory during save and load, what an asynchronous save blocks, and
save/load throughput against torch's own sharded path (FSDP2 + DCP).

Every part runs in its own world of spawned gloo ranks (1 thread each) on one model (default
~95M parameters: dim 1024, 8 layers, SwiGLU 2816, vocabulary 512).

  memory    layouts dp4-zero3, tp2-dp2, pp2-dp2 (4 ranks): the real Trainer, one training
            step, a synchronous save (`checkpoint.save`), an asynchronous one (the Trainer's
            `Checkpointer`, waited for) and a load. Per rank, the peak resident memory of each
            phase (VmHWM, reset through /proc/self/clear_refs, freed heap returned first with
            malloc_trim) over the resident memory when the phase began, in bytes per model
            parameter, beside the rank's own shard (12 bytes per owned parameter: fp32 master
            and two moments). `--src DIR` imports hpctrain from another checkout (e.g. a
            `git worktree` of the commit before sharding, which has no asynchronous save).
  blocking  dp2 ZeRO-1 (2 ranks): the training thread's time in a synchronous save against
            an asynchronous one (`ckpt_block_s`), medians of --repeats.
  torch     2 ranks, the same model and state: hpctrain dp2 ZeRO-3 save (synchronous, with
            its sha256 manifest) and load (the verification timed apart) against FSDP2
            `fully_shard` + `get_state_dict` + `dcp.save` / `dcp.async_save`, and `dcp.load`
            + `set_state_dict`; MB/s of the fp32 state (weights + two moments), medians.

    python benchmarks/bench_ckpt_shards.py --parts memory blocking torch --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def _src(argv: list[str]) -> Path:
    if "--src" in argv:
        return Path(argv[argv.index("--src") + 1]).resolve()
    return ROOT


sys.path.insert(0, str(_src(sys.argv)))  # the hpctrain under test
sys.path.insert(1, str(ROOT))  # benchmarks.common

from benchmarks.common import measure_phase, spawn, to_nn_linear  # noqa: E402


def _model(dim: int, layers: int) -> list[str]:
    """`small`'s vocabulary, 8 heads (4 kv), SwiGLU width 2.75·dim: dim 1024 × 8 layers ≈ 95M."""
    return ["model=small", f"model.dim={dim}", f"model.n_layers={layers}", "model.n_heads=8",
            "model.n_kv_heads=4", f"model.ffn_dim={int(2.75 * dim)}"]


MODEL = _model(*[int(sys.argv[sys.argv.index(k) + 1]) if k in sys.argv else d
                 for k, d in (("--dim", 1024), ("--layers", 8))])
LAYOUTS = {"dp4-zero3": ["parallel.dp=4", "parallel.zero=3"],
           "tp2-dp2": ["parallel.tp=2", "parallel.dp=2"],
           "pp2-dp2": ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"],
           "dp2-zero1": ["parallel.dp=2", "parallel.zero=1"],
           "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"]}


def _config(overrides: list[str], run_dir: str, world: int):
    from hydra import compose, initialize_config_dir

    from hpctrain.config.hydra_schema import register
    from hpctrain.launch import resolvers
    from hpctrain.tasks.configure import parse

    register()
    resolvers.register()
    degree = {o.split("=")[0]: int(o.split("=")[1]) for o in overrides if "=" in o
              and o.split("=")[1].isdigit()}
    batch = degree.get("parallel.dp", 1) * degree.get("parallel.pp", 1)  # pp: ≥ pp microbatches
    base = [*MODEL, "train=debug", "logger.wandb=disabled", "logger.progress=plain",
            "data.max_bytes=200000", "train.eval_every=0", "train.seq_len=64",
            "train.micro_batch_size=1", f"train.global_batch_size={batch}",
            f"cluster.procs_per_node={world}", "cluster.timeout_s=600"]
    with initialize_config_dir(config_dir=str(_src(sys.argv) / "conf"), version_base="1.3"):
        return parse(compose(config_name="config", overrides=[*base, *overrides]),
                     run_dir=run_dir)


def _trainer(overrides: list[str], run_dir: str):
    from hpctrain.distributed.dims import ParallelDims
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.train.trainer import Trainer

    cfg = _config(overrides, run_dir, dist.get_world_size())
    p = cfg.parallel
    dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep)
    mesh = build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu"))
    return cfg, Trainer(cfg, mesh)


# -- resident memory --------------------------------------------------------------------------
def _peak_over_start(fn) -> int:
    """Bytes of resident memory `fn` needed at its peak beyond what was resident before."""
    return measure_phase(fn)[2]


def _own_shard_bytes(trainer) -> int:
    engine = trainer.parallel.engine
    return sum(12 * (u.layout.shard_size - u.layout.shard_padding(u.shard_rank))
               for u in engine.units)


def _save_sync(trainer, cfg, run_dir: str, step: int) -> None:
    from hpctrain.checkpoint import save_load as ckpt

    ckpt.save(ckpt.checkpoint_dir(Path(run_dir), step), parallel=trainer.parallel,
              train_state={"step": step}, rank_state={"scaler": trainer.scaler.state_dict()},
              model_config=cfg.model, keep=0)


def _save_async(trainer, step: int) -> None:
    trainer.step = step
    trainer.save()
    trainer.checkpointer.wait()


def _memory(rank: int, world: int, args) -> dict:
    overrides, run_dir = args
    cfg, trainer = _trainer(overrides, run_dir)
    psi = cfg.model.num_params()
    out = {"train": _peak_over_start(trainer.train_one), "own": _own_shard_bytes(trainer)}
    out["save_sync"] = _peak_over_start(lambda: _save_sync(trainer, cfg, run_dir, 1))
    if hasattr(trainer, "checkpointer"):
        out["save_async"] = _peak_over_start(lambda: _save_async(trainer, 2))
    from hpctrain.checkpoint import save_load as ckpt

    path = ckpt.checkpoint_dir(Path(run_dir), 1)
    out["load"] = _peak_over_start(lambda: ckpt.load(path, parallel=trainer.parallel))
    per_param = {k: v / psi for k, v in out.items()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, per_param)
    return {"psi": psi, "ranks": gathered}


# -- blocking ---------------------------------------------------------------------------------
def _blocking(rank: int, world: int, args) -> dict:
    run_dir, repeats = args
    cfg, trainer = _trainer(LAYOUTS["dp2-zero1"], run_dir)
    trainer.train_one()
    sync, block, background = [], [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        _save_sync(trainer, cfg, run_dir, 100 + i)
        sync.append(time.perf_counter() - t0)
        trainer.step = 200 + i
        trainer.save()
        trainer.checkpointer.wait()
        record = trainer.checkpointer.records[-1]
        block.append(record["ckpt_block_s"])
        background.append(record["ckpt_background_s"])
    return {"sync_s": statistics.median(sync), "block_s": statistics.median(block),
            "background_s": statistics.median(background),
            "bytes": trainer.checkpointer.records[-1]["ckpt_bytes"]}


# -- against FSDP2 + DCP ----------------------------------------------------------------------
def _hpctrain_io(run_dir: str, repeats: int) -> dict:
    from hpctrain.checkpoint import save_load as ckpt

    cfg, trainer = _trainer(LAYOUTS["dp2-zero3"], run_dir)
    trainer.train_one()
    save, load, verify = [], [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        _save_sync(trainer, cfg, run_dir, 10 + i)
        save.append(time.perf_counter() - t0)
        path = ckpt.checkpoint_dir(Path(run_dir), 10 + i)
        t0 = time.perf_counter()
        verified = ckpt.agreed_verified(path)
        t1 = time.perf_counter()
        ckpt.load(verified, parallel=trainer.parallel)
        verify.append(t1 - t0)
        load.append(time.perf_counter() - t1)
    psi = cfg.model.num_params()
    return {"save_s": statistics.median(save), "load_s": statistics.median(load),
            "verify_s": statistics.median(verify), "psi": psi, "cfg": cfg}


def _torch_io(cfg, run_dir: str, repeats: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpctrain.models import build_model

    model = to_nn_linear(build_model(cfg.model, seed=0))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 64))
    model(tokens).float().mean().backward()
    opt.step()
    save, block, total, load = [], [], [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{run_dir}/torch_{i}")
        save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        future = dcp.async_save({"model": msd, "optim": osd},
                                checkpoint_id=f"{run_dir}/torch_async_{i}")
        block.append(time.perf_counter() - t0)
        future.result()
        total.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=f"{run_dir}/torch_{i}")
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        load.append(time.perf_counter() - t0)
    return {"save_s": statistics.median(save), "async_block_s": statistics.median(block),
            "async_total_s": statistics.median(total), "load_s": statistics.median(load)}


def _versus_torch(rank: int, world: int, args) -> dict:
    run_dir, repeats = args
    ours = _hpctrain_io(run_dir, repeats)
    theirs = _torch_io(ours.pop("cfg"), run_dir, repeats)
    return {"hpctrain": ours, "torch": theirs}


# -- report -----------------------------------------------------------------------------------
def _report_memory(layout: str, result: dict) -> None:
    print(f"\n{layout} ({result['psi'] / 1e6:.1f}M parameters): bytes per model parameter")
    keys = [k for k in ("own", "train", "save_sync", "save_async", "load")
            if k in result["ranks"][0]]
    print("| rank | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for rank, row in enumerate(result["ranks"]):
        print(f"| {rank} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")


def _report_torch(result: dict) -> None:
    ours, theirs = result["hpctrain"], result["torch"]
    mb = ours["psi"] * 12 / 1e6
    print(f"\nsave/load of {mb:.0f} MB (fp32 weights + 2 moments), 2 ranks: MB/s (s)")
    print("| | hpctrain | torch FSDP2+DCP | ratio |\n|---|---|---|---|")
    for name, a, b in (("save (sync)", ours["save_s"], theirs["save_s"]),
                       ("load", ours["load_s"], theirs["load_s"]),
                       ("load + verify", ours["load_s"] + ours["verify_s"], theirs["load_s"])):
        print(f"| {name} | {mb / a:.0f} ({a:.2f}) | {mb / b:.0f} ({b:.2f}) | {b / a:.2f} |")
    print(f"| torch async_save: blocked / total | | {theirs['async_block_s']:.2f} / "
          f"{theirs['async_total_s']:.2f} s | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["memory", "blocking", "torch"],
                        choices=["memory", "blocking", "torch"])
    parser.add_argument("--layouts", nargs="+", default=["dp4-zero3", "tp2-dp2", "pp2-dp2"],
                        choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--src", default=str(ROOT), help="checkout whose hpctrain to measure")
    parser.add_argument("--dim", type=int, default=1024, help="model width")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}; hpctrain from {_src(sys.argv)}")
    for part in args.parts:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
            if part == "memory":
                for layout in args.layouts:
                    over = LAYOUTS[layout]
                    world = 4 if layout in ("dp4-zero3", "tp2-dp2", "pp2-dp2") else 2
                    _report_memory(layout, spawn(_memory, (over, f"{tmp}/{layout}"),
                                                 world=world))
            elif part == "blocking":
                r = spawn(_blocking, (tmp, args.repeats), world=2)
                print(f"\nblocking, dp2 ZeRO-1, {r['bytes'] / 1e6:.0f} MB per rank: sync save "
                      f"{r['sync_s']:.3f} s; async blocks {r['block_s']:.3f} s "
                      f"({r['block_s'] / r['sync_s']:.1%}), background {r['background_s']:.3f} s")
            else:
                _report_torch(spawn(_versus_torch, (tmp, args.repeats), world=2))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()

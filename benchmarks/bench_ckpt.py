"""Cost of checkpoint verification: sha256 on save and verification on load, in MB/s and as
a share of save/load time.

One process (a gloo world of 1, FileStore rendezvous), model preset from conf/model (default
`small`, 12.98M parameters: weights + AdamW moments ≈ 156 MB of files), one AdamW step so the
optimizer state exists, then `--repeats` rounds of: `checkpoint.save` (the time spent in
`manifest.digest_files` inside it is the hashing cost), verification with the files in the page
cache (as right after a save) and after evicting them (posix_fadvise DONTNEED: as on a resume
in a new job), `checkpoint.load` right after that verification (the files are cached now), and
`checkpoint.load` of evicted files without verification (what a resume cost before).
Medians are printed as a markdown table.

    python benchmarks/bench_ckpt.py --model small --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from hpctrain.checkpoint import catalog, manifest  # noqa: E402
from hpctrain.checkpoint import save_load as ckpt  # noqa: E402
from hpctrain.config.schema import OptimConfig  # noqa: E402
from hpctrain.distributed.dims import ParallelDims  # noqa: E402
from hpctrain.distributed.mesh import build_mesh  # noqa: E402
from hpctrain.models import ModelConfig, build_model  # noqa: E402
from hpctrain.parallel.data.engine import DataParallel  # noqa: E402
from hpctrain.parallel.data.zero import NormSpec  # noqa: E402
from hpctrain.parallel.scaler import LossScaler  # noqa: E402
from hpctrain.parallel.state import parallel_state, placements  # noqa: E402


def _evict(directory: Path) -> None:
    """Drop the directory's files from the page cache (clean pages; no root needed)."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _model(name: str, dim: int | None, layers: int | None) -> tuple[ModelConfig, torch.nn.Module,
                                                                   DataParallel]:
    preset = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    cfg = ModelConfig(**OmegaConf.to_container(preset))
    if dim or layers:
        cfg = cfg.with_(dim=dim or cfg.dim, n_layers=layers or cfg.n_layers,
                        ffn_dim=int(8 * (dim or cfg.dim) / 3) // 64 * 64)
    model = build_model(cfg, seed=0)
    engine = DataParallel(model, group=dist.group.WORLD, batch_group=dist.group.WORLD,
                          zero=0, precision="fp32",
                          optim=OptimConfig(lr=1e-4), norm=NormSpec())
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    engine.train_step([(tokens, tokens)], n_micro=1, precision="fp32",
                      scaler=LossScaler(enabled=False), grad_clip=1.0)
    mesh = build_mesh(ParallelDims(), rank=0, device=torch.device("cpu"))
    placed = placements(model, tp_plan=None, stages=None, tied=None)
    return cfg, model, parallel_state(model, placed, mesh=mesh, engine=engine)


class _HashClock:
    """Wraps manifest.digest_files to add up the seconds save() spends hashing."""

    def __init__(self):
        self.seconds, self._inner = 0.0, manifest.digest_files

    def __call__(self, directory, *, names):
        t0 = time.perf_counter()
        try:
            return self._inner(directory, names=names)
        finally:
            self.seconds += time.perf_counter() - t0


def _round(run_dir: Path, step: int, cfg, parallel, clock: _HashClock) -> dict[str, float]:
    clock.seconds = 0.0
    t0 = time.perf_counter()
    path = ckpt.save(ckpt.checkpoint_dir(run_dir, step), parallel=parallel,
                     train_state={"step": step, "dp": 1, "tp": 1, "pp": 1, "zero": 0},
                     rank_state={}, model_config=cfg, keep=1)
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    catalog.verify(path)
    warm_s = time.perf_counter() - t0
    _evict(path)
    t0 = time.perf_counter()
    verified = catalog.verify(path)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt.load(verified, parallel=parallel, model_config=cfg)
    load_s = time.perf_counter() - t0
    _evict(path)
    t0 = time.perf_counter()
    ckpt.load(verified, parallel=parallel, model_config=cfg)  # Verified: no re-check
    load_cold_s = time.perf_counter() - t0
    mb = sum(e["size"] for e in verified.manifest["files"].values()) / 1e6
    return {"mb": mb, "save_s": save_s, "hash_s": clock.seconds, "verify_warm_s": warm_s,
            "verify_cold_s": cold_s, "load_s": load_s, "load_cold_s": load_cold_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dim", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=300))
        cfg, _, parallel = _model(args.model, args.dim, args.layers)
        clock = _HashClock()
        manifest.digest_files = clock  # save() calls it through the module
        rows = [_round(Path(tmp) / "run", i + 1, cfg, parallel, clock)
                for i in range(args.repeats)]
        dist.destroy_process_group()
    _report(cfg, rows)


def _report(cfg: ModelConfig, rows: list[dict[str, float]]) -> None:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    mb = med["mb"]
    print(f"model {cfg.name} dim={cfg.dim} layers={cfg.n_layers} "
          f"({cfg.num_params() / 1e6:.2f}M params): {mb:.1f} MB of files, "
          f"median of {len(rows)} rounds\n")
    print("| what | seconds | MB/s | share |\n|---|---|---|---|")
    save_wo = med["save_s"] - med["hash_s"]
    print(f"| save, total | {med['save_s']:.3f} | {mb / med['save_s']:.0f} | |")
    print(f"| sha256 inside save | {med['hash_s']:.3f} | {mb / med['hash_s']:.0f} | "
          f"+{100 * med['hash_s'] / save_wo:.1f}% of save without it |")
    print(f"| verify, page cache warm | {med['verify_warm_s']:.3f} | "
          f"{mb / med['verify_warm_s']:.0f} | |")
    resume = med["verify_cold_s"] + med["load_s"]
    print(f"| verify, evicted (cold) | {med['verify_cold_s']:.3f} | "
          f"{mb / med['verify_cold_s']:.0f} | |")
    print(f"| load after that verify (files now cached) | {med['load_s']:.3f} | "
          f"{mb / med['load_s']:.0f} | |")
    print(f"| load, evicted, without verify (before) | {med['load_cold_s']:.3f} | "
          f"{mb / med['load_cold_s']:.0f} | |")
    print(f"| resume = verify + load (after) | {resume:.3f} | {mb / resume:.0f} | "
          f"+{100 * (resume / med['load_cold_s'] - 1):.1f}% of load without verify |")

if __name__ == "__main__":
    main()

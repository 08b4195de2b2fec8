"""task=dryrun at scale: seconds and host memory of one rank's dry run at 64, 1,024 and 16,384
ranks, and the measured-on-meta vs predicted tables (memory terms, and each process group's
collectives) of llama3_70b, llama3_405b and mixtral_8x7b.

Each dry run runs in a fresh process (`python -m hpctrain task=dryrun ...`): its wall time is
the whole command (Python start, imports, config, every group of the full world, the rank's
model on meta, one step), the peak resident memory that process's (ru_maxrss of the child).
The three scales share one model and layout per rank (llama3_70b, tp 8, pp 2, ZeRO-1, 2
microbatches): only dp grows, so what changes is the world the groups span.

    python benchmarks/bench_dryrun.py --out /tmp/dryrun-bench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["task=dryrun", "cluster=slurm", "cluster.procs_per_node=8", "train.precision=bf16",
          "train.micro_batch_size=1", "train.seq_len=4096", "cluster.accelerator=H200",
          "logger.wandb=disabled"]
LAYOUT_70B = ["model=llama3_70b", "parallel.tp=8", "parallel.pp=2", "parallel.zero=1"]
TABLES = {"llama3_70b (64 ranks: tp 8, pp 2, dp 4, ZeRO-1)":
          [*LAYOUT_70B, "parallel.dp=4", "cluster.nodes=8", "train.global_batch_size=16"],
          "llama3_405b (1,152 ranks: tp 8, pp 9, dp 16, ZeRO-1)":
          ["model=llama3_405b", "parallel.tp=8", "parallel.pp=9", "parallel.dp=16",
           "parallel.zero=1", "cluster.nodes=144", "train.global_batch_size=144"],
          "mixtral_8x7b (64 ranks: tp 2, pp 4, dp 8, ep 8, ZeRO-1)":
          ["model=mixtral_8x7b", "parallel.tp=2", "parallel.pp=4", "parallel.dp=8",
           "parallel.ep=8", "parallel.zero=1", "cluster.nodes=8", "train.global_batch_size=32"]}


def dryrun(overrides: list[str], run_dir: Path) -> tuple[float, float, dict]:
    """(seconds, peak host GiB, dryrun.json) of one `task=dryrun` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hpctrain", *COMMON, *overrides,
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak_kib <= before:  # the max over children did not rise: this one used at most that
        peak_kib = before
    return seconds, peak_kib / 2**20, json.loads((run_dir / "dryrun.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}\n")
    print("| ranks | dp | rank | wall s (whole process) | of which mesh s | setup s | step s "
          "| peak host GiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dp in (4, 64, 1024):
        world = dp * 16
        over = [*LAYOUT_70B, f"parallel.dp={dp}", f"cluster.nodes={world // 8}",
                f"train.global_batch_size={2 * dp}", f"train.eval_samples={dp}",
                f"dryrun.ranks=[{world - 1}]"]
        seconds, gib, report = dryrun(over, args.out / f"scale{world}")
        s = report["ranks"][0]["seconds"]
        print(f"| {world} | {dp} | {world - 1} | {seconds:.1f} | {s['mesh_s']:.2f} | "
              f"{s['setup_s']:.2f} | {s['step_s']:.2f} | {gib:.2f} |")
    for title, over in TABLES.items():
        seconds, gib, report = dryrun(over, args.out / title.split()[0])
        print(f"\n### {title}\n\n{len(report['ranks'])} ranks (the first of each stage and "
              f"the last) in {seconds:.0f} s, peak host {gib:.2f} GiB\n")
        print((args.out / title.split()[0] / "dryrun.md").read_text())
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""The bytes a rank's data-parallel group sends per step, from dry runs of real layouts.

Each case is `python -m hpctrain task=dryrun ...` (rank 0, bf16, H100-SXM): the dry run counts
every collective the rank's step issues on meta tensors (checked op for op against
`hpctrain/plan/comm_volume.py`). Printed per case: the GiB the dp group, the pipeline's
messages ("world") and the tp group send, the rank's device total and activations, and
whether it fits. Run it on two trees (PYTHONPATH) to compare them.

    python benchmarks/dp_wire.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 2**30
BASE = ["task=dryrun", "cluster=slurm", "cluster.procs_per_node=8", "train.micro_batch_size=1",
        "train.precision=bf16", "cluster.accelerator=H100-SXM", "dryrun.ranks=[0]",
        "logger.wandb=disabled"]
CASES = {
    **{f"llama3_8b dp8 zero{z}, seq 4096, 2 micro-batches":
       ["model=llama3_8b", "parallel.dp=8", f"parallel.zero={z}", "cluster.nodes=1",
        "train.seq_len=4096", "train.global_batch_size=16"] for z in (0, 1, 2, 3)},
    "llama3_70b tp8 pp2 dp4 zero1, seq 4096, 2 micro-batches":
        ["model=llama3_70b", "parallel.tp=8", "parallel.pp=2", "parallel.dp=4",
         "parallel.zero=1", "cluster.nodes=8", "train.seq_len=4096",
         "train.global_batch_size=8"],
    "llama3_70b dp64 zero3, seq 8192, full recompute, 1 micro-batch":
        ["model=llama3_70b", "parallel.dp=64", "parallel.zero=3", "cluster.nodes=8",
         "train.seq_len=8192", "train.global_batch_size=64", "train.eval_samples=64",
         "train.activation_checkpointing=full"],
}


def main() -> None:
    print("| case | dp GiB sent | pp hops GiB | tp GiB | device total GiB | activations GiB "
          "| fits |")
    print("|---|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(CASES.items()):
            run_dir = Path(tmp) / str(i)
            subprocess.run([sys.executable, "-m", "hpctrain", *BASE, *overrides,
                            f"hydra.run.dir={run_dir}"], check=True, capture_output=True)
            row = json.loads((run_dir / "dryrun.json").read_text())["ranks"][0]
            sent = {axis: sum(c["bytes"] for g, c in row["comm"].items()
                              if g.split("=")[0] == axis) / GIB
                    for axis in ("dp", "world", "tp")}
            print(f"| {name} | {sent['dp']:.2f} | {sent['world']:.2f} | {sent['tp']:.2f} | "
                  f"{row['total_bytes'] / GIB:.2f} | {row['activations_bytes'] / GIB:.2f} | "
                  f"{row['fits']} |")


if __name__ == "__main__":
    main()

"""Seconds of the planner's layout search (`hpctrain.plan.search.search_layouts`: what
`parallel=auto` and `task=plan` run), Llama 3 70B on 64 A100s, for this tree and an older one,
each in a fresh interpreter, alternating.

    git worktree add /tmp/oldtree <commit>
    python benchmarks/bench_plan_search.py --old /tmp/oldtree --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = """
import json, time
from hpctrain.models import PRESETS
from hpctrain.plan.cluster import megatron_a100_cluster
from hpctrain.plan.search import search_layouts
t = time.perf_counter()
out = search_layouts(PRESETS["llama3_70b"], megatron_a100_cluster(), n_devices=64,
                     global_batch=256, micro_batch_size=1, seq_len=4096)
print(json.dumps({"s": time.perf_counter() - t, "candidates": len(out),
                  "best": str(out[0].layout)}))
"""


def run(tree: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CASE], cwd=tree, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"}, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", type=Path, help="an older source tree to compare with")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    trees = {"this": ROOT, **({"old": args.old} if args.old else {})}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            runs[name].append(run(tree))
    for name, rs in runs.items():
        each = ", ".join(f"{r['s']:.2f}" for r in rs)
        print(f"{name}: median {statistics.median(r['s'] for r in rs):.2f} s ({each}), "
              f"{rs[0]['candidates']} candidates, best {rs[0]['best']}")


if __name__ == "__main__":
    main()

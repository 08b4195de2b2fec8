"""Process start cost: the imports of `python -m hpctrain` and of a training rank, against
`import torch` (the floor every process pays), side by side in one run.

Each measurement is a fresh interpreter timing its own imports (`time.perf_counter` around
the import statements; interpreter start-up excluded, the same for all). Variants alternate
(A B C ... A B C ...) so load drifts hit every one alike; medians are reported. With
`--old PATH` (a checkout of another commit) its launcher and rank are timed too, through
PYTHONPATH, in the same alternation.

  python benchmarks/bench_startup.py --repeats 7 [--old /tmp/oldtree] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

IMPORTS = {
    "torch": "import torch",
    "launcher": "import hpctrain.__main__",  # python -m hpctrain, before it starts ranks
    "rank": "import hpctrain.dispatch, hpctrain.train.trainer",  # a training rank
}
PROBE = ("import time; t0 = time.perf_counter(); {stmt}; "
         "print(time.perf_counter() - t0)")


def time_import(stmt: str, pythonpath: str | None) -> float:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", PROBE.format(stmt=stmt)], env=env,
                         capture_output=True, text=True, check=True, cwd="/")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--old", help="a checkout of an earlier commit, timed alongside")
    ap.add_argument("--out")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    variants = [(name, stmt, here) for name, stmt in IMPORTS.items()]
    if args.old:
        variants += [(f"old {name}", stmt, args.old) for name, stmt in IMPORTS.items()
                     if name != "torch"]
    load = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for _ in range(args.repeats):
        for name, stmt, path in variants:
            times[name].append(time_import(stmt, path))
    med = {name: statistics.median(v) for name, v in times.items()}
    rows = [{"variant": name, "median_s": round(m, 3), "x_torch": round(m / med["torch"], 2),
             "runs": [round(t, 3) for t in times[name]]} for name, m in med.items()]
    report = {"load_before": load, "load_after": os.getloadavg()[0], "rows": rows}
    print("| variant | median imports (s) | × import torch |\n|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['median_s']:.2f} | {r['x_torch']:.2f} |")
    print(f"load average {load:.2f} -> {report['load_after']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

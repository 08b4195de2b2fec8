"""The planner's time model against published runs (issue 31): every row of the reference
tables, predicted vs published with the settings assumed, and each term's effect on the error
(the model with that one term switched back to what it was before issue 31).

    python benchmarks/bench_planner.py [reference dir]   (default: tests/reference)

Prints markdown tables for benchmarks/results/planner.md. No process groups, no devices: the
planner is analytical, so the numbers do not depend on the machine or its load.
"""

from __future__ import annotations

import csv
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from hpctrain.plan import hardware, kernels, published
from hpctrain.plan.assume import Allowed

TABLES = [("megatron_table1", "megatron_table1.csv", "params_b"),
          ("korthikanti_full", "korthikanti2022_visible.csv", "model"),
          ("korthikanti_selective", "korthikanti2022_visible.csv", "model"),
          ("megatron_h100", "megatron_h100_visible.csv", "model_size")]


def rows(directory: Path, name: str) -> list[dict[str, str]]:
    with open(directory / name) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


@contextmanager
def patched(obj, attr, value):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def _source(name, **changes):
    return patched(published, "SOURCES",
                   {**published.SOURCES, name: replace(published.SOURCES[name], **changes)})


def ablations(name: str):
    """(label, context manager) pairs, each reverting one term of issue 31 for `name`."""
    src = published.SOURCES[name]
    no_share = {g: replace(k, nvlink=1.0, nic=1.0) for g, k in hardware.KERNELS.items()}
    out = [("eager attention", _source(name, attention="eager")),
           ("no cross entropy", patched(kernels, "CE_BYTES_PER_LOGIT", 0)),
           ("links at datasheet", patched(hardware, "KERNELS", no_share)),
           ("mbs 1, v 1 (no search)", _source(name, allowed=Allowed(
               (1,), src.allowed.recomputes[:1], (1,))))]
    if src.stack.tp == "full":
        out += [("no tp overlap", _source(name, stack=replace(src.stack, tp="none"))),
                ("no dp overlap", _source(name, stack=replace(src.stack, dp=False))),
                ("no pp overlap", _source(name, stack=replace(src.stack, pp=False))),
                ("bf16 grad reduce", _source(name, stack=replace(src.stack,
                                                                  grad_reduce="param")))]
    return out


def main(directory: Path) -> None:
    print("| table | row | published | predicted | error | assumed |")
    print("|---|---|---|---|---|---|")
    for name, path, key in TABLES:
        for row in rows(directory, path):
            p = published.predict_row(name, row)
            print(f"| {name} | {row[key]} | {p.published:.4g} | {p.predicted:.4g} | "
                  f"{p.error:+.1%} | {p.assumed.describe()} |")
    print("\nError with one term reverted (the rest as above):\n")
    for name, path, key in TABLES:
        labels = [label for label, _ in ablations(name)]
        print(f"| {name} | " + " | ".join(["all terms", *labels]) + " |")
        print("|---" * (len(labels) + 2) + "|")
        for row in rows(directory, path):
            cells = [f"{published.predict_row(name, row).error:+.1%}"]
            for _, ctx in ablations(name):
                with ctx:
                    cells.append(f"{published.predict_row(name, row).error:+.1%}")
            print(f"| {row[key]} | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests/reference"))

"""benchmarks/gpu/run.sh --dry-run: the prepared GPU benchmark runs end to end on CPU.

It must leave every section's numbers: attention rows for sdpa and triton in both directions and
flex forward, with and without documents; an MFU row for each backend that can train on CPU and
flex refused with its message; bf16 and FP8 rows of the fp8 section; the tests/gpu log.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_benchmark_dry_run_writes_every_section(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--dry-run",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    attention = json.loads((tmp_path / "attention.json").read_text())["rows"]
    done = {(r["backend"], r["direction"], r["docs_per_row"] > 1)
            for r in attention if "error" not in r and r["tflops"] > 0}
    for docs in (False, True):
        assert {("sdpa", "fwd+bwd", docs), ("triton", "fwd+bwd", docs),
                ("flex", "fwd", docs)} <= done
    mfu = {r["backend"]: r for r in json.loads((tmp_path / "mfu.json").read_text())["rows"]}
    for name in ("sdpa", "triton", "eager"):
        assert mfu[name]["tokens_per_s"] > 0, mfu[name]
    assert "no backward on CPU" in mfu["flex"]["error"]
    fp8 = {r["fp8"]: r for r in json.loads((tmp_path / "fp8.json").read_text())["rows"]}
    assert fp8[True]["tokens_per_s"] > 0 and fp8[False]["tokens_per_s"] > 0, fp8
    assert "skipped" in (tmp_path / "tests_gpu.txt").read_text()
    assert (tmp_path / "attention.md").exists() and (tmp_path / "env.txt").exists()
    rows = json.loads((tmp_path / "compile.json").read_text())["rows"]
    compiled = {r["compile"]: r for r in rows}
    assert compiled["none"]["tokens_per_s"] > 0 and compiled["blocks"]["tokens_per_s"] > 0
    assert compiled["blocks"]["compiled_graphs"] >= 1, compiled["blocks"]
    assert compiled["blocks"]["recompiles_after_warmup"] == 0, compiled["blocks"]

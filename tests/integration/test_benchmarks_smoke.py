"""Every side-by-side benchmark still runs end to end at toy sizes, so a change in the model or
the engines cannot silently break them (the merges of issue 12/13 once did: a stage signature
and a DTensor input plan). Numbers are not checked here; benchmarks/results/*.md hold them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOY = ["--seq", "16", "--dim", "32", "--layers", "2"]
RUNS = {
    "dp": ["benchmarks/bench_dp.py", "--steps", "1", "--warmup", "1", "--batch", "1",
           "--vocab", "64", "--heads", "2", "--kv-heads", "1", "--ffn", "64", *TOY],
    "tp": ["benchmarks/bench_tp.py", "--steps", "1", "--warmup", "0", "--batch", "1", *TOY],
    "pp": ["benchmarks/bench_pp.py", "--steps", "1", "--warmup", "0", "--microbatches", "4",
           "--t-f", "0.001", "--t-b", "0.001", "--t-w", "0.001", "--sleep-steps", "1",
           "--seq", "16", "--dim", "32", "--layers", "4"],
    "moe": ["benchmarks/bench_moe.py", "--world", "2", "--steps", "1", "--warmup", "0",
            "--batch", "1", "--seq", "16", "--dim", "32"],
    "startup": ["benchmarks/bench_startup.py", "--repeats", "1"],
    "hf_interop": ["benchmarks/bench_hf_interop.py", "--dim", "64", "--layers", "2", "--vocab",
                   "512", "--ffn", "128", "--heads", "4", "--kv-heads", "2", "--world", "2"],
    "prepare": ["benchmarks/bench_prepare.py", "--mb", "1", "--files", "2", "--workers", "1,2",
                "--vocab", "2000", "--train-mb", "1", "--shard-mb", "0.25"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_benchmark_runs_at_toy_size(name):
    done = subprocess.run([sys.executable, *RUNS[name]], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "|" in done.stdout  # a results table was printed

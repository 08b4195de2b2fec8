"""What a person sees: the first command under an 80-column pseudo-terminal and redirected
(logs and progress on stderr, the summary last on stdout), `<group> --help` from the schema,
and Hydra's own errors as hpctrain's one message with exit 2."""

from __future__ import annotations

import re
import subprocess
import sys

import pexpect

from hpctrain.config.cli import group_help
from hpctrain.dispatch import format_result
from tests.conftest import ROOT

RUN = ["-m", "hpctrain", "model=debug", "train=debug", "data.max_bytes=300000",
       "logger.wandb=disabled", "train.steps=12", "train.log_every=5"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_progress_fits_80_columns_and_summary_comes_last(tmp_path):
    child = pexpect.spawn(sys.executable, [*RUN, f"hydra.run.dir={tmp_path}"], cwd=str(ROOT),
                          dimensions=(24, 80), encoding="utf-8", timeout=240)
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before[-3000:]
    screen = ANSI.sub("", child.before)
    lines = [ln for ln in re.split(r"[\r\n]+", screen) if ln.strip()]
    bars = [ln for ln in lines if ln.startswith("step 12/12")]
    assert bars, lines
    assert all(w in bars[-1] for w in ("loss", "tok/s", "ETA")), bars[-1]
    progress = [ln for ln in lines if ln.startswith("step ")]
    assert max(len(ln) for ln in progress) <= 80, max(progress, key=len)
    assert not any("INFO]" in ln for ln in progress)  # log lines print above the bar
    assert lines.index(bars[-1]) < lines.index("run summary")
    assert lines[-2].startswith("outputs in ") and set(lines[-1]) == {"─"}


def test_redirected_logs_on_stderr_with_eta_and_summary_on_stdout(tmp_path):
    proc = subprocess.run([sys.executable, *RUN, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run summary" in proc.stdout and "INFO]" not in proc.stdout
    assert "run summary" not in proc.stderr
    steps = [ln for ln in proc.stderr.splitlines() if "] step " in ln]
    assert [ln.split("] step ")[1].split()[0] for ln in steps] == ["1/12", "5/12", "10/12",
                                                                  "12/12"]
    assert all(re.search(r"eta=\d+:\d\d:\d\d", ln) for ln in steps), steps
    log = proc.stderr  # no silent minutes: a line before the build and before the first step
    assert log.index("] building debug (") < log.index("] training steps 1..12") < log.index(
        "] step 1/12")
    assert proc.stdout.rstrip().splitlines()[-2] == (
        f"outputs in {tmp_path} (summary.json, metrics.jsonl, training.png, checkpoints/)")
    assert not (tmp_path / "hang").exists()  # only after a hang; heartbeats in .hpctrain/
    assert (tmp_path / ".hpctrain" / "heartbeat" / "rank_0.json").exists()


def test_misspelled_option_and_key_exit_2_with_one_message(tmp_path):
    for bad, fix in (("model=llama3-8b", "did you mean model=llama3_8b?"),
                     ("train.eval_batches=4", "replaced by train.eval_samples")):
        proc = subprocess.run([sys.executable, "-m", "hpctrain", bad,
                               f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("invalid configuration (1 problem(s))"), proc.stderr
        assert fix in proc.stderr and "Traceback" not in proc.stderr


def test_group_help_gives_meaning_default_and_choices():
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "parallel", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "parallel.grad_comm_dtype = fp32   choices: fp32 | bf16 | fp16" in proc.stdout
    assert "presets: parallel=3d | auto | cp2 | dp2 | pp2 | single" in proc.stdout
    top = subprocess.run([sys.executable, "-m", "hpctrain", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert "`python -m hpctrain <group> --help`" in top.stdout, top.stdout[-2000:]
    text = group_help("train.eval_samples")
    assert text.splitlines()[1] == "  train.eval_samples = 16   range: > 0"
    assert "split over the dp ranks" in text
    assert group_help("model.moe.top_k").splitlines()[1:] == ["  model.moe.top_k = 2   range: > 0"]
    assert "  model.rope_scaling.factor = 8.0   range: ≥ 1" in group_help("model").splitlines()
    assert group_help("nosuch") is None and group_help("model.moe.nosuch") is None


def test_every_task_says_where_its_outputs_went(tmp_path):
    report = tmp_path / "bench_report.md"
    report.write_text("| op | GB/s |\n|---|---|\n| all_reduce | 1.5 |\n")
    bench = format_result("bench", {"report": str(report), "json": str(tmp_path / "b.json")})
    assert "| all_reduce | 1.5 |" in bench and bench.endswith(f"outputs: {report}, "
                                                             f"{tmp_path / 'b.json'}")
    assert format_result("prepare", {"data_dir": "/d"}) == "prepared tokens: /d"

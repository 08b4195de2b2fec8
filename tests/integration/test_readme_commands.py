"""Every command of the README's code blocks runs and exits 0 (issue 28), in README order, in
one working directory, so a later command finds what an earlier one made (`outputs/run1`,
`hf/run1`, the sbatch files).

What changes between the README and the run:
- placeholders become files built here, never downloaded (`PLACES`): a text corpus, a JSON Lines
  corpus, a word-level tokenizer, a tiny random Llama with that tokenizer, prompts, a local
  lm-eval task; `cluster=my_site` (the user's own preset) becomes `example_site`;
- runs are short (`_short`): a few steps, no W&B, no training.png, sequences of at most 64
  tokens, benchmarks of a few timed calls on small messages and matrices;
- a command whose comment says `[needs ...]` (Slurm, a GPU, the network) is skipped with that
  reason: the local Slurm cluster's own tests (tests/slurm) run those paths; the README's two
  set-up commands are what `.ci/run` runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

NEEDS = re.compile(r"\[needs ([^\]]+)\]")
SETUP = ("pip install torch==2.13.0 -e . && python -m hpctrain", "bash tests/run.sh")
SHORT_STEPS, STOP_AT = 4, 2


@dataclass(frozen=True)
class Command:
    line: int
    text: str  # continuation lines joined
    comment: str

    @property
    def needs(self) -> str | None:
        found = NEEDS.search(self.comment)
        return found.group(1) if found else None


def readme_commands() -> list[Command]:
    """Every command line of the README's bash blocks (comment-only lines left out)."""
    out, block, pending = [], False, None
    for i, raw in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if raw.startswith("```"):
            block = raw.strip() == "```bash"
            continue
        if not block or not raw.strip() or raw.lstrip().startswith("#"):
            continue
        code, _, comment = raw.partition("  # ")
        if pending is None:
            pending = (i, "", "")
        line, text, comments = pending
        text += " " + code.strip().rstrip("\\").strip()
        comments += " " + comment
        if code.rstrip().endswith("\\"):
            pending = (line, text, comments)
            continue
        out.append(Command(line, text.strip(), comments.strip()))
        pending = None
    return out


COMMANDS = readme_commands()


def test_the_readme_marks_what_cannot_run_here():
    """A submission to Slurm (a multirun with a Slurm cluster, sbatch) or a command that
    downloads says so in its comment; the parser finds the README's commands."""
    assert len(COMMANDS) > 30
    for c in COMMANDS:
        words = c.text.split()  # a multirun's -m follows the module: python -m hpctrain -m
        at = next((i for i, w in enumerate(words) if w == "hpctrain" and words[i - 1] == "-m"),
                  None)
        multirun = at is not None and "-m" in words[at + 1:]
        slurm = (multirun and re.search(r"cluster=(slurm|my_site)", c.text)) \
            or re.search(r"(^|[\s(])sbatch\s", c.text)
        if slurm:
            assert c.needs and "Slurm" in c.needs, c
        if "hellaswag" in c.text:
            assert c.needs and "network" in c.needs, c


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The working directory, with a file for every placeholder (module docstring)."""
    from tests.hf_models import save_tiny_llama
    from tests.integration.test_lm_eval_adapter import TASK_YAML
    from tests.unit.tokenizer_files import hf_tokenizer_dir

    w = tmp_path_factory.mktemp("readme")
    texts = sorted((Path(os.__file__).parent / "email").glob("*.py"))  # 0.36 MB of text
    (w / "texts").mkdir()
    for p in texts:
        (w / "texts" / f"{p.stem}.txt").write_text(p.read_text())
    words = " ".join(f"w{i % 40}" for i in range(64))
    (w / "corpus").mkdir()
    (w / "corpus" / "part.jsonl").write_text("".join(
        json.dumps({"text": f"hello world , {words} {i}"}) + "\n" for i in range(2000)))
    hf_tokenizer_dir(w / "models" / "tok")
    model = w / "models" / "Llama-3.2-1B"
    save_tiny_llama(model, tied=True)
    hf_tokenizer_dir(model)
    (w / "prompts.txt").write_text("def main():\nimport os\n")
    (w / "tasks").mkdir()
    docs = [{"question": "hello", "choices": [" world", " w3"], "answer": 0}] * 3
    (w / "my_task.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (w / "tasks" / "my_task.yaml").write_text(
        TASK_YAML.replace("tiny_choice", "my_task").format(data=w / "my_task.jsonl"))
    return w


def _placed(text: str, w: Path) -> str:
    for old, new in (("/path/to/", f"{w}/texts/"), ("/data/corpus/", f"{w}/corpus/"),
                     ("/models/", f"{w}/models/"), ("/scratch/", f"{w}/scratch/"),
                     ("cluster=my_site", "cluster=example_site"),
                     ("step_00001000", f"step_{SHORT_STEPS:08d}")):
        text = text.replace(old, new)
    return text


def _short(argv: list[str]) -> list[str]:
    """A few steps of a training run, no W&B, rows of at most 64 tokens (module docstring)."""
    keys = {a.split("=", 1)[0]: i for i, a in enumerate(argv) if "=" in a}
    task = argv[keys["task"]].split("=", 1)[1] if "task" in keys else "train"
    if task == "bench":  # a few timed calls of small messages and matrices
        return [*argv, "bench.iters=3", "bench.warmup=1", "bench.max_bytes=262144",
                "bench.gemm_max_dim=512"]
    if task not in ("train", "prepare"):
        return argv
    forced = {"logger.wandb": "disabled"}
    if task == "train":  # the picture (~1.3 s of matplotlib a run) is tested on its own
        forced.update({"train.steps": str(SHORT_STEPS), "optim.warmup_steps": "1",
                       "logger.plot": "false"})
        if "train.stop_after" in keys:
            forced["train.stop_after"] = str(STOP_AT)
    if "train.seq_len" not in keys or int(argv[keys["train.seq_len"]].split("=")[1]) > 64:
        forced["train.seq_len"] = "64"  # bf16 and FP8 GEMMs are slow on a CPU
    out = list(argv)
    for key, value in forced.items():
        if key in keys:
            out[keys[key]] = f"{key}={value}"
        else:
            out.append(f"{key}={value}")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS, ids=[f"L{c.line}" for c in COMMANDS])
def test_readme_command_exits_0(command: Command, work: Path):
    if command.text in SETUP or command.text.startswith(SETUP[0]):
        pytest.skip(".ci/run runs the README's set-up commands (tests/fresh_venv.sh, then "
                    "tests/run.sh)")
    if command.needs:
        pytest.skip(f"the README says it needs {command.needs}")
    if command.text.startswith("pip install"):
        pytest.skip("the test suite's install (tests/run.sh: '.[dev]') holds every extra")
    argv = shlex.split(_placed(command.text, work))
    assert argv[:2] == ["python", "-m"], f"README line {command.line}: not a python -m command"
    argv = [sys.executable, *argv[1:3], *(_short(argv[3:]) if argv[2] == "hpctrain"
                                          else argv[3:])]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "hf_cache")}
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"README line {command.line}: {' '.join(argv)}\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")

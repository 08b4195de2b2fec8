"""The layer contract of pyproject.toml ([tool.importlinter]) holds, and it can fail.

`lint-imports` checks two contracts: the layers (errors < ops | distributed < models < parallel
< config < data | metrics | checkpoint < train < bench < plan < tasks < launch < dispatch <
__main__; every top-level module must be placed) and no import cycles between the siblings of
any package. Imports inside functions count as imports, so
moving one into a function does not dodge the contract. The second test breaks a copy of the
package on purpose (a lower layer importing a higher one, a cycle inside a package) and checks
that the linter refuses it, naming the import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """Run import-linter on the `hpctrain` package under `root` with `root`'s pyproject.toml."""
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    env = {**os.environ, "PYTHONPATH": str(root)}  # this copy of hpctrain, not the installed one
    try:
        return subprocess.run([*cmd, "--config", str(root / "pyproject.toml"), "--no-cache"],
                              cwd=root, env=env, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.fail("lint-imports not found: install the dev extra (pip install -e '.[dev]')")


def test_the_package_keeps_its_layers_and_has_no_cycles():
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout, proc.stdout


# (file to break, line appended, what the report must say)
BREAKS = {
    "lower imports higher": ("models/config.py", "from hpctrain.train import trainer",
                             "hpctrain.models is not allowed to import hpctrain.train"),
    "the schema imports a task": ("config/schema.py", "from hpctrain import tasks",
                                  "hpctrain.config is not allowed to import hpctrain.tasks"),
    "import inside a function": ("metrics/throughput.py",
                                 "def _f():\n    from hpctrain.plan import inputs",
                                 "hpctrain.metrics is not allowed to import hpctrain.plan"),
    "cycle inside the config package": ("config/rule.py", "from hpctrain.config import validate",
                                        "No cycles are allowed in hpctrain.config"),
    "cycle inside a package": ("plan/cluster.py", "from hpctrain.plan import calibrate",
                               "No cycles are allowed in hpctrain.plan"),
}


def test_a_broken_contract_fails_with_its_report(tmp_path):
    """All BREAKS in one copy (one linter run): each is named in the report."""
    shutil.copytree(ROOT / "hpctrain", tmp_path / "hpctrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for path, line, _ in BREAKS.values():
        broken = tmp_path / "hpctrain" / path
        broken.write_text(f"{broken.read_text()}\n{line}  # noqa\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout
    for case, (_, _, report) in BREAKS.items():
        assert report in proc.stdout, (case, proc.stdout)


def test_the_package_root_holds_the_entry_point_the_dispatch_and_the_errors():
    """Every other module lives in a package whose name says what it holds (issue 43: 16
    modules at the root once took 8 of the contract's layers)."""
    root = ROOT / "hpctrain"
    modules = sorted(p.name for p in root.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "dispatch.py", "errors.py"], modules
    packages = sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["bench", "checkpoint", "config", "data", "distributed", "launch",
                        "metrics", "models", "ops", "parallel", "plan", "tasks", "train"]

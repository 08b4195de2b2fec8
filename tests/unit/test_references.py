"""Docs that match the code: every dotted name `hpctrain.<module>[.<attribute>]` and every source
path `hpctrain/<...>.py` written in the README, the configs, the docstrings, comments and
benchmarks names a module or attribute that exists. A file moved or a function renamed without
its mentions fails here, naming the file that still points at the old place."""

from __future__ import annotations

import importlib
import re
import subprocess

from tests.conftest import ROOT

DOTTED = re.compile(r"(?<![\w./{-])hpctrain(?:\.[A-Za-z_]\w*)+")
SOURCE = re.compile(r"(?<![\w/])hpctrain(?:/\w+)+\.py")
SUFFIXES = (".py", ".md", ".yaml", ".sh", ".toml")
NOT_NAMES = (".py", ".md", ".json", ".yaml", ".log", ".bin")  # file names, not modules


def _files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    # results record what a past version measured: they may name what it had
    return [f for f in listed if f.endswith(SUFFIXES) and not f.startswith("benchmarks/results")
            and (ROOT / f).is_file()]


def _resolves(dotted: str) -> bool:
    """The longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_named_module_and_source_file_exists():
    from hpctrain.launch.resolvers import RESOLVERS  # ${hpctrain.nodes:...}: OmegaConf's names

    stale: dict[str, set[str]] = {}
    for name in _files():
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        for m in DOTTED.finditer(text):
            dotted = m.group(0).rstrip(".")
            if (not dotted.endswith(NOT_NAMES) and dotted not in RESOLVERS
                    and not _resolves(dotted)):
                stale.setdefault(dotted, set()).add(name)
        for m in SOURCE.finditer(text):
            if not (ROOT / m.group(0)).is_file():
                stale.setdefault(m.group(0), set()).add(name)
    assert not stale, "\n".join(f"{ref}: named in {', '.join(sorted(files))}"
                                for ref, files in sorted(stale.items()))

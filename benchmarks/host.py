"""Results-file helpers that import nothing heavy: bench_prepare's spawned processes import
its module, so torch here would add seconds to every process and its memory to every peak."""

from __future__ import annotations

import importlib
import os
import platform


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def host_line(*packages: str) -> str:
    """The host (cores, memory, machine) and the versions of torch and `packages`, one line
    for a results file."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    versions = ", ".join(f"{name} {importlib.import_module(name).__version__}"
                         for name in ("torch", *packages))
    return (f"host: {os.cpu_count()} cores, {gib(mem)} GiB memory, {platform.machine()}; "
            f"{versions}; python {platform.python_version()}")

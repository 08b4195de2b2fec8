"""Importing hpctrain changes nothing process-wide (issue 12 item 7).

A fresh interpreter imports every module of the package (the entry point too, without running
it) and compares what a library import must not touch: OmegaConf resolvers and Hydra's
ConfigStore (the entry points register them, `hpctrain.__main__`), matplotlib's backend,
signal handlers, the environment, the root logger and torch's defaults (not warning filters:
torch's lazy import of sympy adds one). The entry point's own registration is checked too: it
registers, and registering twice is harmless.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

PROBE = r"""
import importlib, logging, os, pkgutil, signal
import matplotlib
import torch
import torch._dynamo  # torch's own import sets TORCHINDUCTOR_CACHE_DIR (cache_dir_utils); an
# earlier test in the same pytest process used to hide that from this probe
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
def state():
    return {"backend": dict.__getitem__(matplotlib.rcParams, "backend"),
            "signals": [signal.getsignal(s) for s in SIGNALS], "env": dict(os.environ),
            "root_handlers": list(logging.getLogger().handlers),
            "root_level": logging.getLogger().level,
            "torch": (torch.get_default_dtype(), torch.get_num_threads()),
            "resolver": OmegaConf.has_resolver("hpctrain.nodes"),
            "schemas": sorted(ConfigStore.instance().repo.get("schema", {}))}
before = state()
import hpctrain
names = [m.name for m in pkgutil.walk_packages(hpctrain.__path__, "hpctrain.")]
for name in names:
    importlib.import_module(name)
after = state()
changed = [k for k in before if before[k] != after[k]]
assert not changed, {k: (before[k], after[k]) for k in changed}
assert len(names) > 100 and "hpctrain.__main__" in names, names

from hpctrain.config import hydra_schema
from hpctrain.launch import resolvers
for _ in range(2):  # what the entry point does, twice: idempotent
    hydra_schema.register()
    resolvers.register()
assert OmegaConf.has_resolver("hpctrain.nodes")
cfg = OmegaConf.create({"parallel": {"dp": 4, "tp": 2, "pp": 1, "cp": 1},
                        "n": "${hpctrain.nodes:${parallel},4}"})
assert cfg.n == 2, cfg.n
assert "train.yaml" in ConfigStore.instance().repo["schema"]
print("ok", len(names))
"""


def test_importing_every_module_has_no_process_wide_side_effects():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MPLBACKEND", None)  # matplotlib's backend must stay unresolved, as a user left it
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.startswith("ok"), proc.stdout


LIGHT = r"""
import sys
if sys.argv[1] == "launcher":
    import hpctrain.__main__  # `python -m hpctrain`
    heavy = ("torch.distributed.checkpoint", "torch._dynamo", "matplotlib",
             "hpctrain.train.trainer")
else:
    import hpctrain.dispatch, hpctrain.train.trainer  # what a training rank imports
    heavy = ("torch._dynamo", "matplotlib", "hydra", "transformers", "wandb")
print(sorted(m for m in heavy if m in sys.modules))
"""


def test_launcher_and_ranks_import_only_what_they_run():
    """Every `python -m hpctrain` and every rank it starts pays for its imports (seconds each
    on a small CPU, and a test suite starts hundreds): the launcher imports no trainer,
    checkpoint reader, compiler or plotting; a training rank imports no compiler (until
    train.compile asks), plotting (until it draws), Hydra, Transformers or W&B."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for who in ("launcher", "rank"):
        out = subprocess.run([sys.executable, "-c", LIGHT, who], capture_output=True,
                             text=True, cwd=ROOT, env=env, timeout=120, check=True).stdout
        assert out.strip() == "[]", (who, out)


def test_every_deferred_import_resolves():
    """Imports inside functions (deferred so that a process pays only for what it runs) are
    not executed by importing the package: check each name they import exists, so a moved
    function fails here rather than in the one task that imports it."""
    import ast
    import importlib
    from pathlib import Path

    import hpctrain

    root = Path(hpctrain.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                        and node.module.startswith("hpctrain")):
                    module = importlib.import_module(node.module)
                    missing += [f"{path.relative_to(root)}:{node.lineno} {node.module}.{a.name}"
                                for a in node.names if not hasattr(module, a.name)
                                and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, missing

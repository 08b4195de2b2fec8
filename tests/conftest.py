"""Session-wide fixtures: persistent gloo worlds and config composition."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from tests.harness import World

# The `triton` attention backend runs on CPU only under Triton's interpreter, and a process
# fixes that mode when it first imports triton (its language library is jitted then). Switch it
# on here, before any test imports triton or spawns a world (ranks inherit the environment),
# on machines without CUDA; with CUDA the kernels run natively (tests/gpu) and the interpreted
# tests skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


_hydra: list = []  # the Hydra this process initialised on conf/ (kept: its loader caches files)
_composed: dict[tuple[str, ...], object] = {}


def compose(overrides: list[str] | None = None):
    """Compose conf/config.yaml with Hydra overrides, as the entry point would. One Hydra on
    conf/ is made per process and installed for each compose (a fresh one per call reloads
    every file: twice the time), and each distinct override list is composed once."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hpctrain.config.hydra_schema import register
    from hpctrain.launch import resolvers

    key = tuple(overrides or ())
    if key not in _composed:  # conf/ does not change during a session: a copy of the last one
        register()  # what the entry point does before Hydra composes (hpctrain.__main__)
        resolvers.register()
        hydra = GlobalHydra.instance()
        before = hydra.hydra if hydra.is_initialized() else None
        hydra.clear()
        try:
            if not _hydra:
                initialize_config_dir(config_dir=str(CONF), version_base="1.3")
                _hydra.append(hydra.hydra)
            else:
                hydra.initialize(_hydra[0])
            _composed[key] = hydra_compose(config_name="config", overrides=list(key))
        finally:  # the global state as it was (code under test initialises its own)
            hydra.clear()
            if before is not None:
                hydra.initialize(before)
    return copy.deepcopy(_composed[key])  # 8 ms; a compose is 0.3-0.9 s


def make_config(overrides: list[str] | None = None, *, run_dir: Path | str = "."):
    """A parsed, validated Config (ValueError on a bad one)."""
    from hpctrain.tasks.configure import parse

    return parse(compose(overrides), run_dir=str(run_dir), overrides=list(overrides or ()))


_worlds: dict[int, World] = {}


def get_world(size: int) -> World:
    if size not in _worlds:
        _worlds[size] = World(size)
    return _worlds[size]


@pytest.fixture(scope="session")
def world2() -> World:
    return get_world(2)


@pytest.fixture(scope="session")
def world4() -> World:
    return get_world(4)


@pytest.fixture(scope="session")
def world8() -> World:
    """8 ranks on few cores is slow (~9 s to spawn): keep to the one or two 3D tests."""
    return get_world(8)


def pytest_sessionfinish(session, exitstatus):
    for world in _worlds.values():
        world.close()


@pytest.fixture(autouse=True, scope="session")
def _quiet_env():
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield


# With pytest-xdist (tests/run.sh: -n 2 --dist loadgroup --no-loadscope-reorder) each worker
# takes whole groups, in the order given here: a test file is a group (its module fixtures and
# cached references are computed once), the 8-rank worlds' files and tests (marked world8) share
# one (one worker holds an 8-rank world), and the Slurm tests are one group, first in line: they
# mostly wait on the cluster, so the other worker runs the rest meanwhile. Then the longest
# groups (LONGEST: seconds alone on an idle 2-core machine, 2026-12-07), so that no long group
# starts last and runs alone at the end; then the rest in file order.
LONGEST = {"tests/integration/test_readme_commands.py": 238,
           "tests/parallel/test_compat_matrix.py": 131, "tests/integration/test_hang.py": 83,
           "tests/integration/test_benchmarks_smoke.py": 79, "world8": 70,
           "tests/integration/test_ckpt_async.py": 68, "tests/parallel/test_fp8_parallel.py": 56,
           "tests/integration/test_dryrun.py": 43, "tests/unit/test_attention_backends.py": 42,
           "tests/integration/test_gpu_bench_dry_run.py": 41,
           "tests/unit/test_plan_search.py": 31, "tests/parallel/test_moe.py": 30,
           "tests/parallel/test_cp.py": 28}
_WORLD8_FILES = {"test_3d_trainer.py", "test_3d_runtime.py", "test_ckpt_sharded.py",
                 "test_zero_tp_pp.py", "test_hsdp.py"}


def _group(item) -> str:
    if item.get_closest_marker("slurm"):
        return "slurm"
    name = item.path.name
    if name in _WORLD8_FILES or item.get_closest_marker("world8"):
        return "world8"
    return str(item.path.relative_to(ROOT))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into nodeids
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
    def rank(item) -> tuple[int, int]:
        group = _group(item)
        return (0, 0) if group == "slurm" else (1, -LONGEST.get(group, 0))

    items.sort(key=rank)  # stable: groups stay whole, the rest keeps its order

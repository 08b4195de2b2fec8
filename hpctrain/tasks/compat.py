"""The composition matrix: which pairs of hpctrain's features a run may combine, from the
validation rules themselves (`python -m hpctrain task=compat`).

Each feature is a set of config values (FEATURES) on a fixed base (BASE: the `debug` model's
shape, 8 sequences of 32 tokens per step). A pair's config is the union of its two features'
values; `parallel.dp` takes the larger of the two (ZeRO, offload, experts and HSDP each need
data-parallel ranks), and the job gets as many ranks as the layout has. The pair is then
  - "·" when the two set one key to different values (two ZeRO stages, two schedules):
    alternatives, not a combination;
  - refused when `hpctrain.config.validate` refuses the config: the cell points at the reason;
  - ✔ otherwise. Every ✔ pair is run: `covering_runs` groups the pairs into a few runs, each
    combining several features, so that every ✔ pair is inside at least one run
    (tests/parallel/test_compat_matrix.py trains each run and compares its loss and gradient
    norm per step with the single process).
A run in bf16 (bf16, FP8) is compared at bf16's tolerance, so it counts only the pairs that
contain its bf16 feature; every other pair is covered by an fp32 run. Runs hold at most 8 ranks.
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.config.schema import Config, collect
from hpctrain.tasks import problems

MAX_RANKS = 8

# The base every cell starts from: the `debug` preset's shape (conf/model/debug.yaml), one
# sequence of 32 tokens per micro-batch, 8 per step (2 micro-batches per rank at dp = 4, as
# many as pp = 2 needs), rows of one text each (data.packing=none; the `docs` feature packs).
BASE: dict[str, Any] = {
    "model.name": "debug", "model.vocab_size": 512, "model.dim": 32, "model.n_layers": 4,
    "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 96, "model.max_seq_len": 128,
    "train.global_batch_size": 8, "train.micro_batch_size": 1, "train.seq_len": 32,
    "train.eval_every": 0, "data.packing": "none", "cluster.device": "cpu",
    "logger.wandb": "disabled",
}

_MOE = {"model.moe.num_experts": 8, "model.moe.every": 2, "model.moe.expert_ffn_dim": 48}


@dataclass(frozen=True)
class Feature:
    name: str  # the matrix's column label
    title: str  # what it is, for the legend
    values: tuple[tuple[str, Any], ...]
    # Seconds it adds per rank to a run of 3 steps (covering_runs' estimate; compile: tracing
    # and compiling the blocks, measured on 2 CPU cores)
    cost: float = 0.0


def _feature(name: str, title: str, *, cost: float = 0.0, **values: Any) -> Feature:
    return Feature(name, title, tuple((key.replace("__", "."), value)
                                      for key, value in values.items()), cost)


def _pp(schedule: str, **more: Any) -> Feature:
    return _feature(schedule, f"pp = 2, parallel.schedule={schedule}", parallel__pp=2,
                    parallel__schedule=schedule, **more)


FEATURES: tuple[Feature, ...] = (
    _feature("dp", "data parallel, dp = 2", parallel__dp=2),
    _feature("z1", "ZeRO-1 (dp = 2)", parallel__dp=2, parallel__zero=1),
    _feature("z2", "ZeRO-2 (dp = 2)", parallel__dp=2, parallel__zero=2),
    _feature("z3", "ZeRO-3 (dp = 2)", parallel__dp=2, parallel__zero=3),
    _feature("off", "optimizer offload to the host (dp = 2)", parallel__dp=2,
             parallel__offload="cpu"),
    _feature("hsdp", "HSDP: dp = 4 as 2 replicas × 2 shards", parallel__dp=4,
             parallel__dp_replicate=2),
    _feature("tp", "tensor parallel, tp = 2", parallel__tp=2),
    _feature("sp", "tp = 2 with sequence parallelism", parallel__tp=2, parallel__sp=True),
    _pp("gpipe"), _pp("1f1b"),
    _pp("interleaved_1f1b", parallel__virtual_stages=2),
    _pp("zb_h1"), _pp("zb_h2"), _pp("zbv"),
    _feature("cp", "context parallel (ring attention), cp = 2", parallel__cp=2),
    _feature("moe", "mixture of experts: 8 experts, top 2, every 2nd block", **{
        k.replace(".", "__"): v for k, v in _MOE.items()}),
    _feature("ep", "experts sharded over ep = 2 ranks (dp = 2)", parallel__dp=2, parallel__ep=2,
             **{k.replace(".", "__"): v for k, v in _MOE.items()}),
    _feature("sel", "selective activation checkpointing",
             train__activation_checkpointing="selective"),
    _feature("full", "full activation checkpointing", train__activation_checkpointing="full"),
    _feature("bf16", "bf16 autocast (train.precision=bf16)", train__precision="bf16"),
    _feature("fp8", "FP8 linears (train.precision=bf16)", train__precision="bf16",
             train__fp8=True),
    _feature("compile", "train.compile=blocks", train__compile="blocks", cost=3.0),
    _feature("docs", "packed documents (data.packing=documents)", data__packing="documents"),
)
BY_NAME = {f.name: f for f in FEATURES}
# Keys two features may both set: the run takes the larger value.
_LARGER = ("parallel.dp",)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def combine(names: tuple[str, ...]) -> dict[str, Any] | None:
    """The values of features `names` together, or None when two set one key differently."""
    values: dict[str, Any] = {}
    for name in names:
        for key, value in BY_NAME[name].values:
            if key in values and values[key] != value:
                if key not in _LARGER:
                    return None
                value = max(value, values[key])
            values[key] = value
    return values


def ranks(values: dict[str, Any]) -> int:
    return int(values.get("parallel.dp", 1) * values.get("parallel.tp", 1)
               * values.get("parallel.pp", 1) * values.get("parallel.cp", 1))


def overrides(names: tuple[str, ...]) -> list[str]:
    """Hydra overrides of BASE with features `names` (and cluster.procs_per_node = the ranks)."""
    values = {**BASE, **combine(names)}
    values["cluster.procs_per_node"] = ranks(values)
    return [f"{key}={_text(value)}" for key, value in values.items()]


def _nested(values: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for dotted, value in values.items():
        *path, last = dotted.split(".")
        node = raw
        for part in path:
            node = node.setdefault(part, {})
        node[last] = copy.deepcopy(value)
    return raw


def _checked(names: tuple[str, ...], run_dir: str, more: dict[str, Any]):
    """(Config or None, the problems hpctrain.config.validate finds) of features `names` on BASE,
    with the values `more` on top."""
    values = {**BASE, **combine(names), **more}
    values["cluster.procs_per_node"] = ranks(values)
    config, found = collect(_nested(values), run_dir=run_dir)
    if config is None:
        return None, tuple(p.text for p in found)
    return config, tuple(p.text for p in problems(config, found=found))


@functools.cache
def refusals(names: tuple[str, ...]) -> tuple[str, ...] | None:
    """Why hpctrain.config.validate refuses features `names` together (empty: accepted); None when
    they are alternatives (one key, two values)."""
    if combine(names) is None:
        return None
    return _checked(names, ".", {})[1]


def config(names: tuple[str, ...], *, run_dir: str, more: dict[str, Any] | None = None):
    """The validated Config of features `names` together — the cell's own config, which the
    matrix's tests run — with the values `more` (dotted keys) on top; ValueError if refused."""
    if combine(names) is None:
        raise ValueError(f"features {names} set one key to two values")
    built, refused = _checked(names, run_dir, dict(more or {}))
    if refused:
        raise ValueError(f"features {names} are refused: " + "; ".join(refused))
    return built


def pairs() -> list[tuple[str, str]]:
    return list(itertools.combinations([f.name for f in FEATURES], 2))


_PAIR_INDEX = {pair: i for i, pair in enumerate(pairs())}


def accepted_pairs() -> list[tuple[str, str]]:
    return [pair for pair in pairs() if refusals(pair) == ()]


_LOW_PRECISION = ("bf16", "fp8")


def _covers(run: tuple[str, ...]) -> set[tuple[str, str]]:
    """The pairs a passing run proves: all of its pairs; in a bf16 run only those of its
    bf16 feature (bf16 or fp8)."""
    got = set(itertools.combinations(run, 2))
    low = [name for name in _LOW_PRECISION if name in run]
    return {p for p in got if low[0] in p} if low else got


def cost(run: tuple[str, ...], *, cores: int = 2) -> float:
    """The run's estimated seconds on `cores` CPU cores (fitted to runs on 2): 1 to build a
    trainer, and per rank 0.05 for 3 steps of the debug model plus what its features add,
    stretched by the oversubscription of ranks over cores."""
    n = ranks({**BASE, **combine(run)})
    return 1.0 + n * max(1.0, n / cores) * (0.05 + sum(BY_NAME[f].cost for f in run))


_FEATURE_INDEX = {f.name: i for i, f in enumerate(FEATURES)}


def _order(names) -> tuple[str, ...]:
    return tuple(sorted(names, key=_FEATURE_INDEX.__getitem__))


def _runnable(run: tuple[str, ...]) -> bool:
    values = combine(run)
    return (values is not None and ranks({**BASE, **values}) <= MAX_RANKS
            and refusals(run) == ())


def _value(run: tuple[str, ...], *, todo: frozenset) -> float:
    """New pairs covered per estimated second."""
    return len(_covers(run) & todo) / cost(run)


@functools.cache
def covering_runs() -> tuple[tuple[str, ...], ...]:
    """Runs (feature tuples, each accepted, ≤ MAX_RANKS ranks) that together cover every
    accepted pair (`_covers`), found greedily and deterministically: from the first pair not
    yet covered a run grows by the feature that covers the most new pairs per unit of `cost`
    while any adds one; the run kept is the step of that growth that covers the most new
    pairs per unit of cost."""
    todo = set(accepted_pairs())
    runs: list[tuple[str, ...]] = []
    while todo:
        value = functools.partial(_value, todo=frozenset(todo))
        run = min(todo, key=_PAIR_INDEX.__getitem__)
        path = [run]
        while True:
            grown = [g for g in (_order((*run, f.name)) for f in FEATURES if f.name not in run)
                     if _runnable(g) and len(_covers(g) & todo) > len(_covers(run) & todo)]
            if not grown:
                break
            run = max(grown, key=value)
            path.append(run)
        run = max(path, key=value)
        todo -= _covers(run)
        runs.append(run)
    return tuple(runs)


BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"


def table() -> str:
    """The matrix as Markdown: ✔ accepted (and run by tests/parallel/test_compat_matrix.py),
    ✘ⁿ refused for reason n below, · alternatives (one key, two values); then the legend."""
    names = [f.name for f in FEATURES]
    reasons: list[str] = []

    def cell(a: str, b: str) -> str:
        if a == b:
            return "—"
        why = refusals(_order((a, b)))
        if why is None:
            return "·"
        if not why:
            return "✔"
        marks = []
        for text in why:
            if text not in reasons:
                reasons.append(text)
            marks.append(str(reasons.index(text) + 1))
        return "✘" + ",".join(marks)

    rows = [f"| | {' | '.join(names)} |", f"|---|{'---|' * len(names)}"]
    rows += [f"| **{a}** | {' | '.join(cell(a, b) for b in names)} |" for a in names]
    legend = [f"- **{f.name}**: {f.title}" for f in FEATURES]
    notes = [f"{i}. {text}" for i, text in enumerate(reasons, 1)]
    return "\n".join([
        "Each pair on the base of `hpctrain.tasks.compat.BASE` (the debug model, 8 sequences of 32 "
        "tokens per step), with as many ranks as its layout needs. ✔: accepted, and trained in "
        "tests/parallel/test_compat_matrix.py against the single process; ✘n: refused before "
        "launch, for reason n; ·: alternatives (one key, two values).",
        "", *rows, "", *legend, "", "Refused:", "", *notes])


def run_compat(cfg: Config) -> dict[str, Any]:
    """task=compat: the matrix, written to compat.md in the run directory."""
    text = table()
    path = Path(cfg.run_dir) / "compat.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return {"text": text, "path": str(path)}


def readme_section(readme: str) -> str:
    """The text between BEGIN and END in `readme` (ValueError when the markers are missing)."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {BEGIN} … {END} section")
    return readme[start + len(BEGIN):end].strip("\n")

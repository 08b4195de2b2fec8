"""torch.compile applied from outside the model (`train.compile`).

`blocks` compiles each transformer block on its own (regional compilation, as torchtitan
does); `model` compiles the whole forward (the Transformer, or each pipeline stage with its
loss). Identical blocks share one compiled graph: dynamo inlines nn.Module calls and takes
parameters as graph inputs (torch ≥ 2.6 always inlines built-in modules), so `n_layers` blocks
cost one compilation, not `n_layers` (tests/unit/test_compile.py counts the graphs).

The module's `forward` is replaced in place by a compiled function, as activation
checkpointing does (hpctrain.models.checkpointing), and after it: parameter names stay the
full model's (no `_orig_mod.`), and checkpoint's recomputation becomes part of the compiled
graph. `nn.Module.compile()` is not used: over a forward that checkpointing replaced, torch
2.13 compiled nothing (dynamo skipped the frame; measured).

Packed documents: `Documents.mask_BLL` is a cached_property whose lock dynamo cannot trace
(one graph break per block). A forward pre-hook builds the mask before the compiled region,
so the blocks read it as one more tensor input: a new document layout of the same shape never
recompiles. Shapes that change from step to step (dynamic batching) recompile once, after which
dynamo marks those dims dynamic (automatic_dynamic_shapes).

Tensor-parallel collectives (hpctrain.parallel.tensor.comm) run outside the graph: each is a
clean graph break (torch.compiler.disable), traced once, never a recompilation per step.

Modules whose class sets `compile_eagerly = True` run eagerly inside the compiled regions
(their forward becomes torch.compiler.disable's, set here when compiling): a block is then its
graphs around one clean break, a fixed number whatever they do. Mixture of experts: routing
makes data-dependent shapes (each expert's token count, the kept assignments) that change every
step, so a traced MoE layer would recompile until dynamo gave up (tests/parallel/test_moe.py
counts the graphs over 20 steps). Ring attention (cp) needs no mark: dynamo breaks the graph
at its point-to-point exchanges by itself, and a cp=2 run compiles nothing after the second
step (tests/parallel/test_compat_matrix.py, the runs with compile).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.models.registry import model_blocks
from hpctrain.ops.documents import Documents

log = logging.getLogger(__name__)

MODES = ("none", "blocks", "model")
MASK_BACKENDS = ("eager", "sdpa")  # attention backends that read Documents.mask_BLL
_BEFORE_COMPILE: list[Callable[[], None]] = []


def before_compile(hook: Callable[[], None]) -> None:
    """Run `hook` before the first compilation of this process: layers above the models
    (tensor parallelism's communication ops) mark what must stay out of graphs without
    importing torch._dynamo until something is compiled."""
    _BEFORE_COMPILE.append(hook)


def compile_forward(module: nn.Module) -> None:
    """Replace `module.forward` (whatever it is now, e.g. checkpoint's wrapper) by a compiled
    function calling it; the module, its hooks and its parameter names are untouched."""
    for hook in _BEFORE_COMPILE:  # each is idempotent
        hook()
    inner = module.forward

    def forward(*args, **kwargs):
        return inner(*args, **kwargs)

    module.forward = torch.compile(forward)


def _prime_documents(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: build the documents' attention mask eagerly (see module docstring)."""
    docs = kwargs.get("docs")
    if isinstance(docs, Documents):
        docs.mask_BLL()


def _stage_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that run a whole forward: a pipeline rank's stages, or the model."""
    parts = getattr(model, "parts", None)
    return list(parts.values()) if isinstance(parts, dict) else [model]


def apply_compile(model: nn.Module, mode: str, *, attention: str) -> None:
    """Compile the blocks of `model` (the whole model, or a pipeline rank's stages) or each
    whole forward, in place. Call after tensor parallelism and
    activation checkpointing. `attention`: model.attention, whether blocks read the mask."""
    if mode not in MODES:
        raise ValueError(f"train.compile={mode!r}: use none|blocks|model")
    if mode == "none":
        return
    whole = _stage_modules(model)
    for module in model.modules():  # MoE layers, ring attention: eager (module docstring)
        if getattr(type(module), "compile_eagerly", False):
            module.forward = torch.compiler.disable(module.forward)
    if attention in MASK_BACKENDS:
        for module in whole:
            module.register_forward_pre_hook(_prime_documents, with_kwargs=True)
    if mode == "model":
        for module in whole:
            compile_forward(module)
        return
    for block in model_blocks(model):
        compile_forward(block)


@dataclass(frozen=True)
class CompileStats:
    """What torch compiled in this process so far: graphs and seconds spent compiling."""

    graphs: int
    seconds: float


def compile_stats() -> CompileStats:
    """Graphs compiled and compile seconds (dynamo + inductor, forward and backward) of this
    process, from torch's own counters (private API, read only here). They start at zero
    when dynamo is first imported, so before that nothing was compiled and dynamo (~1.5 s of
    imports) is not loaded just to say so."""
    if "torch._dynamo" not in sys.modules:
        return CompileStats(graphs=0, seconds=0.0)
    from torch._dynamo.utils import compilation_time_metrics, counters

    graphs = int(counters["stats"]["unique_graphs"])
    seconds = sum(sum(compilation_time_metrics.get(key, ()))
                  for key in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler"))
    return CompileStats(graphs=graphs, seconds=seconds)


class CompileWatch:
    """Compile accounting of a run's train steps. The first `warm_steps` steps may compile (the
    first compiles, the second may recompile once with dims turned dynamic); a graph compiled
    in a later train step is a recompilation, logged as a warning and counted in `summary`.
    Graphs of the eval forward (no grad: its own graphs) count in the total only."""

    def __init__(self, *, warm_steps: int = 2):
        self.warm_steps, self.steps = warm_steps, 0
        self.start = compile_stats()
        self.recompiles = 0
        self.train_graphs = 0

    @contextlib.contextmanager
    def step(self):
        """Wrap one train step."""
        before = compile_stats()
        yield
        self.steps += 1
        now = compile_stats()
        if self.steps == self.warm_steps and now.graphs > self.start.graphs:
            self.train_graphs = now.graphs - self.start.graphs
            log.info("compiled %d graph(s) for the train step in %.1f s (an eval forward "
                     "compiles its own, counted in the summary's compiled_graphs)",
                     self.train_graphs, now.seconds - self.start.seconds)
        new = now.graphs - before.graphs
        if self.steps > self.warm_steps and new:
            self.recompiles += new
            log.warning("train step %d compiled %d new graph(s) after warm-up: a guard failed "
                        "(rerun with TORCH_LOGS=recompiles to see which)", self.steps, new)

    def summary(self) -> dict[str, float | int]:
        now = compile_stats()
        return {"compile_s": round(now.seconds - self.start.seconds, 3),
                "compiled_graphs": now.graphs - self.start.graphs,  # train + eval + after warm-up
                "compiled_graphs_train_step": self.train_graphs,
                "recompiles_after_warmup": self.recompiles}

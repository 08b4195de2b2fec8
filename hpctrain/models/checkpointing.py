"""Activation checkpointing applied from outside the model.

`full` recomputes every block in backward (keeps only block inputs); `selective` recomputes
just the attention core (the L² part), as in Korthikanti et al. 2022.

The module's own `forward` is wrapped in place (no wrapper module), so parameter names stay the
full model's (`layers.3.attn.wq.weight`, never `layers.3.inner...`): checkpoints, tensor-parallel
plans and parity comparisons line up with and without recomputation, at any pipeline layout.
Recomputation reruns hpctrain's Linear forward inside the backward, so a zero-bubble B action
that defers weight gradients files closures holding the *recomputed* inputs (see
hpctrain.ops.linear): the W action needs nothing else.

Under context parallelism (hpctrain.parallel.context) `full` reruns each block's ring attention
in backward, communication included: every cp rank recomputes the same layer at the same point
of its backward (the ranks walk the same layers in the same order), forward and backward
traffic carry separate tags, and the ring merges its blocks in a fixed order, so the recompute
reproduces the first forward's output and log-sum-exp (the fp64 cp=2 tests check it). That
costs (cp − 1) key/value shards per layer more (counted in comm_cp_bytes and the planner), and
keeps full's promise of holding only block inputs. The alternative, keeping the ring's own
output and log-sum-exp through the recompute, would hold about another block input per layer.
`selective` leaves a core whose class sets `selective_recompute = False` (ring attention) as it
is: it keeps no score matrix (only q, k/v, its output and log-sum-exp, as FlashAttention does),
so recomputing it would rerun the ring to free almost nothing.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpctrain.models.registry import family_of, model_blocks

MODES = ("none", "selective", "full")


# What a checkpointed block's recomputation runs inside, or None: set by the activation meter
# while it measures (hpctrain.metrics.activations counts the rerun's saved tensors, which
# torch keeps under its own hooks). Read at the block's forward; not under train.compile.
RECOMPUTE_CONTEXT: ContextVar[Callable[[], AbstractContextManager] | None] = ContextVar(
    "hpctrain_recompute_context", default=None)


def _recomputed_forward(module: nn.Module, *args, **kwargs):
    # compiling first: dynamo would break the graph at the ContextVar
    observe = None if torch.compiler.is_compiling() else RECOMPUTE_CONTEXT.get()
    if observe is None:
        return checkpoint(type(module).forward, module, *args, use_reentrant=False, **kwargs)
    return checkpoint(type(module).forward, module, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), observe()), **kwargs)


def recompute_in_backward(module: nn.Module) -> None:
    """Make `module(...)` keep only its inputs and rerun its class's forward during backward.
    A method bound to one shared function, not a per-module partial: torch.compile guards a
    partial on its identity, so each block would compile its own graph (train.compile)."""
    module.forward = types.MethodType(_recomputed_forward, module)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint the blocks (`full`) or attention cores (`selective`) of `model` (the whole
    model, a part, or a pipeline rank's stages) in place."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r}: use none|selective|full")
    if mode == "none":
        return
    core_name = family_of(model.cfg).attention_core
    for block in model_blocks(model):
        core = block.get_submodule(core_name)
        if mode == "full":
            recompute_in_backward(block)
        elif getattr(core, "selective_recompute", True):
            recompute_in_backward(core)

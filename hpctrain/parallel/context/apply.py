"""Context parallelism applied to a model from outside, by module name (like the tp plan):
every block's attention core (where its family declares it) becomes a RingAttentionCore over
the cp group. The rest of the
model runs unchanged on the zigzag shard: RoPE reads the shard's full-row positions from its
ShardDocuments, and every other op is per token; MoE layers route their tokens where they are
and sum their router statistics over the cp group (hpctrain.models.moe.layer).
"""

from __future__ import annotations

from torch import nn

from hpctrain.models.moe.layer import moe_layers
from hpctrain.models.registry import family_of, model_blocks
from hpctrain.parallel.context.allgather import allgather_attention
from hpctrain.parallel.context.ring import RingComm, ring_attention


class RingAttentionCore(nn.Module):
    """Drop-in for a block's attention core under cp > 1 (no parameters)."""

    # Keeps no score matrix: `selective` activation checkpointing leaves it alone rather
    # than rerun the ring (hpctrain.models.checkpointing).
    selective_recompute = False

    def __init__(self, comm: RingComm, *, backend: str, transport: str = "ring"):
        super().__init__()
        self.fn = allgather_attention if transport == "allgather" else ring_attention
        # The per-block math follows the backend RingComm was built with (context/backends.py:
        # eager, sdpa's fused CPU forward, hpctrain's Triton kernels); `backend` names it.
        self.comm, self.backend = comm, backend

    def forward(self, q_BNSH, k_BKSH, v_BKSH, docs=None):
        return self.fn(q_BNSH, k_BKSH, v_BKSH, docs, comm=self.comm)


def apply_context_parallel(model: nn.Module, comm: RingComm, *, token_group,
                           transport: str = "ring") -> nn.Module:
    """Replace every block's attention core of `model` (the whole model, or a rank's pipeline
    stages; its family says where the core is) by ring attention over `comm` (`transport`
    "ring", or "allgather": parallel.cp_comm), in place; returns `model`. A cp group of one
    rank leaves the model as it is. The last stage's loss stays the shard's own mean; the step
    weights it by the shard's real tokens over the dp×cp group
    (hpctrain.parallel.step.loss_divisors). MoE layers sum their routing statistics over
    `token_group`, the ranks holding the parts of the rows: the cp group (`comm.group`), or
    under sp the cp×tp ranks (the mesh's cp_tp group)."""
    if comm.size == 1:
        return model
    for layer in moe_layers(model):  # tokens routed where they are, statistics over the row
        layer.token_group = token_group
    parent, _, attr = family_of(model.cfg).attention_core.rpartition(".")
    for block in model_blocks(model):
        owner = block.get_submodule(parent) if parent else block
        core = getattr(owner, attr)
        setattr(owner, attr, RingAttentionCore(comm, backend=core.backend, transport=transport))
    return model

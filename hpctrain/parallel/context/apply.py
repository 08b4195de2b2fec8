"""Context parallelism applied to a model from outside, by module name (like the tp plan):
every `layers.<i>.attn.core` becomes a RingAttentionCore over the cp group. The rest of the
model runs unchanged on the zigzag shard: RoPE reads the shard's full-row positions from its
ShardDocuments, and every other op is per token.
"""

from __future__ import annotations

from torch import nn

from hpctrain.parallel.context.allgather import allgather_attention
from hpctrain.parallel.context.ring import RingComm, ring_attention


class RingAttentionCore(nn.Module):
    """Drop-in for models.llama.AttentionCore under cp > 1 (no parameters)."""

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


def apply_context_parallel(model: nn.Module, comm: RingComm, *,
                           transport: str = "ring") -> nn.Module:
    """Replace every attention core of `model` (in place) by ring attention over `comm`
    (`transport` "ring", or "allgather": parallel.cp_comm); returns `model`. A cp group of
    one rank leaves the model as it is."""
    if comm.size == 1:
        return model
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:  # a ModuleList (whole model) or ModuleDict (a rank's pipeline stages)
        block.attn.core = RingAttentionCore(comm, backend=block.attn.core.backend,
                                            transport=transport)
    return model


def apply_to_stages(local: nn.Module, comm: RingComm, *, transport: str = "ring") -> None:
    """cp on a rank's pipeline stages (`LocalStages`): ring attention in every block. The
    last stage's loss stays the shard's own mean; the step weights it by the shard's real
    tokens over the dp×cp group (hpctrain.parallel.step.loss_divisors)."""
    apply_context_parallel(local, comm, transport=transport)

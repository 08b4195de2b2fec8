"""Activation checkpointing applied from outside the model.

`full` recomputes every block in backward (keeps only block inputs); `selective` recomputes
just the attention core (the L² part), as in Korthikanti et al. 2022.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


class Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return checkpoint(self.inner, *args, use_reentrant=False)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap blocks (`full`) or attention cores (`selective`) of `model.layers` in place."""
    if mode == "none":
        return
    for i, block in enumerate(model.layers):
        if mode == "full":
            model.layers[i] = Checkpointed(block)
        elif mode == "selective":
            block.attn.core = Checkpointed(block.attn.core)
        else:
            raise ValueError(f"train.activation_checkpointing={mode!r}: use none|selective|full")

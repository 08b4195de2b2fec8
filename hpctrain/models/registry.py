"""Which family builds a model: `family_of(cfg)`, the blocks of a built model, and a part of it
on the meta device (`meta_part`: what the planner counts, built as a run builds it)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.models.family import ModelFamily, Part
from hpctrain.models.llama import FAMILY as LLAMA


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family that builds `cfg`'s model. Every ModelConfig describes a Llama-style decoder
    today (hf_config maps the Hugging Face families onto it); a family key joins the config
    when a family with other modules arrives."""
    return LLAMA


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks `model` holds, in layer order: a whole model, a part, or a rank's pipeline
    stages (anything with the `cfg` of its family)."""
    return [block for _, block in family_of(model.cfg).block_items(model)]


@functools.lru_cache(maxsize=128)
def meta_part(cfg: ModelConfig, part: Part) -> nn.Module:
    """`part` of cfg's model on the meta device: its modules, parameter names, shapes and
    registration order exactly as a run builds them, without memory or initialisation (a
    block of a 70B model in ~4 ms). Cached and shared: read it, never change it."""
    with torch.device("meta"):
        return family_of(cfg).build(cfg, part)

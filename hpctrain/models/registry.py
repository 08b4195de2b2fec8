"""Which family builds a model: `family_of(cfg)`, and the blocks of a built model."""

from __future__ import annotations

from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.models.family import ModelFamily
from hpctrain.models.llama.model import FAMILY as LLAMA


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family that builds `cfg`'s model. Every ModelConfig describes a Llama-style decoder
    today (hf_config maps the Hugging Face families onto it); a family key joins the config
    when a family with other modules arrives."""
    return LLAMA


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks `model` holds, in layer order: a whole model, a part, or a rank's pipeline
    stages (anything with the `cfg` of its family)."""
    return [block for _, block in family_of(model.cfg).block_items(model)]

"""Model definitions (no parallel code), shapes and deterministic init."""

import torch
from torch import nn

from hpctrain.models.config import PRESETS, ModelConfig
from hpctrain.models.family import ModelFamily, Part
from hpctrain.models.init import full_init, init_weights
from hpctrain.models.llama.model import Transformer
from hpctrain.models.registry import family_of, model_blocks


def build_model(cfg: ModelConfig, *, seed: int, part: Part | None = None) -> nn.Module:
    """The model, or `part` of it (a pipeline stage's layers and ends), in fp32 on CPU,
    initialised deterministically by parameter name: every part holds exactly the values the
    whole model has. A head without its tied embedding starts as a copy of the embedding."""
    family = family_of(cfg)
    part = Part.whole(cfg) if part is None else part
    model = family.build(cfg, part)
    init_weights(model, cfg, seed=seed)
    if cfg.tied_embeddings and part.head and not part.embed:
        head = getattr(model, family.head).weight
        with torch.no_grad():
            head.copy_(full_init(f"{family.embedding}.weight", head.shape, cfg, seed=seed))
    return model


__all__ = ["PRESETS", "ModelConfig", "ModelFamily", "Part", "Transformer", "build_model",
           "family_of", "init_weights", "model_blocks"]

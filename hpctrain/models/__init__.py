"""Model definitions (no parallel code), shapes and deterministic init."""

from hpctrain.models.config import PRESETS, ModelConfig
from hpctrain.models.init import init_weights
from hpctrain.models.llama import Transformer


def build_model(cfg: ModelConfig, *, seed: int) -> Transformer:
    """The full single-process model in fp32 on CPU, initialised deterministically."""
    model = Transformer(cfg)
    init_weights(model, cfg, seed=seed)
    return model


__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "init_weights"]

"""Tiny random Hugging Face Llama models saved locally (no download), for the import tests."""

from __future__ import annotations

from pathlib import Path

import torch

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_llama(*, tied: bool, dtype=torch.float32, seed: int = 0, **extra):
    """A random LlamaForCausalLM: vocab 512 (the byte tokenizer's), width 64, 2 layers, 4
    query / 2 kv heads, Llama 3.1 RoPE scaling over a 16-token original context (so the
    scaled, blended and kept frequencies all occur), random norm gains."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, rope_theta=500000.0,
                      rope_scaling=dict(SCALING), tie_word_embeddings=tied,
                      rms_norm_eps=1e-5, **extra)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones: a swapped norm would show
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def tiny_mistral(*, seed: int = 0):
    """A random MistralForCausalLM of `tiny_llama`'s shape without a sliding window (as
    Mistral 7B v0.2+), default RoPE."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=128, sliding_window=None)
    return MistralForCausalLM(cfg).eval()


def save_tiny_llama(directory: Path, **kw):
    """`tiny_llama(**kw)` saved with save_pretrained (safetensors); returns the model."""
    model = tiny_llama(**kw)
    model.save_pretrained(directory)
    return model


def _random_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones: a swapped norm would show
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):  # Qwen2 starts its biases at zero
                p.copy_(0.1 * torch.randn_like(p))
    return model


def tiny_qwen2(*, seed: int = 0, dtype=torch.float32):
    """A random Qwen2ForCausalLM (q/k/v biases) of `tiny_llama`'s shape, tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=True)
    return _random_norms(Qwen2ForCausalLM(cfg).to(dtype).eval())


def tiny_qwen3(*, seed: int = 0, dtype=torch.float32):
    """A random Qwen3ForCausalLM (q/k RMSNorm) whose head_dim (32) is not hidden / heads (16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=128)
    return _random_norms(Qwen3ForCausalLM(cfg).to(dtype).eval())


def tiny_mixtral(*, seed: int = 0, dtype=torch.float32):
    """A random MixtralForCausalLM: 4 experts of width 96, top 2, in both blocks."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=512, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=128, sliding_window=None)
    return _random_norms(MixtralForCausalLM(cfg).to(dtype).eval())


FAMILIES = {"qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "mixtral": tiny_mixtral}

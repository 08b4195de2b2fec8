"""One whole model on one device, with no ranks and no optimizer: what task=generate and
task=eval run. Its weights come from a checkpoint (a checkpoint directory, or a run directory's
newest verified checkpoint, of any layout: `hf_export.read_full_model`) or from a local Hugging
Face model directory (`model.init_from`: every tensor of its safetensors, renamed by
`hf_names`). Either holds the model once in host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint.hf_export import find_checkpoint, read_full_model
from hpctrain.checkpoint.hf_import import (
    hf_sources,
    place,
    read_piece,
    safe_open_or_explain,
    weight_files,
)
from hpctrain.config.build import build
from hpctrain.models import family_of
from hpctrain.models.config import ModelConfig
from hpctrain.models.llama.hf_config import model_keys, read_hf_config, unsupported


@dataclass
class OneDevice:
    """A loaded model: its shape, the module (eval mode), where it came from, the step of the
    checkpoint (None for a Hugging Face directory) and the run directory it belongs to."""

    shape: ModelConfig
    model: torch.nn.Module
    source: Path
    step: int | None
    run_dir: Path | None


def _into(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: Path, *,
          shape: ModelConfig) -> None:
    """Copy `tensors` (hpctrain names) into `model`; a tied head may be absent. ValueError
    naming the first missing or mis-shaped weight."""
    state = model.state_dict()
    head = f"{family_of(shape).head}.weight" if shape.tied_embeddings else None
    missing = [n for n in state if n not in tensors and n != head]
    if missing:
        raise ValueError(f"{source} has no weight {missing[0]!r} of the model its shape "
                         f"describes ({len(missing)} missing): is it complete?")
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in state:
                raise ValueError(f"{source} holds {name!r}, which the model has not")
            if tuple(t.shape) != tuple(state[name].shape):
                raise ValueError(f"{source}: {name} has shape {list(t.shape)}, the model "
                                 f"needs {list(state[name].shape)}")
            state[name].copy_(t)


def _from_checkpoint(source: str | Path, key: str) -> tuple[ModelConfig, dict, Path, int, Path]:
    found = find_checkpoint(source, key=key)
    saved = found.manifest.get("model")
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {found.path} records no model shape (written by an older "
                         "hpctrain): resume it once with this version")
    shape = build(ModelConfig, "model", saved)
    return shape, read_full_model(found.path), found.path, found.step, found.path.parent.parent


def hf_shape(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face directory; ValueError naming what is unsupported."""
    hf = read_hf_config(directory)
    bad = unsupported(hf)
    if bad:
        raise ValueError(f"{directory}: config.json sets what hpctrain does not implement: "
                         f"{'; '.join(bad)}")
    return build(ModelConfig, "model", {"name": Path(directory).name, **model_keys(hf),
                                        "init_from": str(directory)})


def _bare(shape: ModelConfig) -> torch.nn.Module:
    """The model's modules on the meta device: names and shapes, no memory, no init."""
    with torch.device("meta"):
        return family_of(shape).build(shape, None)


def _from_hf(directory: str | Path, shape: ModelConfig) -> dict[str, torch.Tensor]:
    """Every weight of the model, whole, read from `directory` (the family says from where)."""
    files = weight_files(directory)
    safe_open = safe_open_or_explain()
    out = {}
    for name, meta in _bare(shape).state_dict().items():
        if shape.tied_embeddings and name == f"{family_of(shape).head}.weight":
            continue  # the embedding's
        box = tuple(slice(0, n) for n in meta.shape)
        for piece in hf_sources(name, tuple(meta.shape), box, files, Path(directory)):
            with safe_open(files[piece.hf], framework="pt") as f:
                value = read_piece(f, piece, Path(directory))
            if piece.row is None:  # the whole weight, in the file's dtype
                out[name] = value
            else:  # one expert of a stacked weight
                place(out.setdefault(name, torch.empty(meta.shape, dtype=value.dtype)), piece,
                      value)
    return out


def load_one_device(*, from_: str | None = None, init_from: str | None = None,
                    dtype: torch.dtype = torch.float32, device: str = "cpu",
                    key: str = "from") -> OneDevice:
    """The model of checkpoint/run directory `from_`, else of Hugging Face directory
    `init_from` (exactly one is given), in `dtype` on `device`, in eval mode. `key` is the
    setting that gave `from_` (generate.from), named when it holds no checkpoint."""
    if (from_ is None) == (init_from is None):
        raise ValueError("give exactly one source: a run directory or checkpoint, or "
                         "model.init_from=<a Hugging Face directory>")
    if from_ is not None:
        shape, tensors, source, step, run_dir = _from_checkpoint(from_, key)
    else:
        shape, source, step, run_dir = hf_shape(init_from), Path(init_from), None, None
        tensors = _from_hf(init_from, shape)
    model = _bare(shape).to_empty(device=device).to(dtype)
    family = family_of(shape)
    if shape.tied_embeddings:  # to_empty unties them
        getattr(model, family.head).weight = getattr(model, family.embedding).weight
    _into(model, tensors, source, shape=shape)
    model.rope(torch.device(device))  # built for this device before any forward
    return OneDevice(shape, model.eval(), source, step, run_dir)


def run_config(run_dir: Path | None) -> dict[str, Any] | None:
    """The run's saved configuration (`.hydra/config.yaml`) as a dict, or None."""
    saved = None if run_dir is None else run_dir / ".hydra" / "config.yaml"
    if saved is None or not saved.is_file():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(saved), resolve=False)

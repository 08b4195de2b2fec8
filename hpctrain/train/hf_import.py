"""Initial weights from a Hugging Face model directory (`model.init_from`), read per rank.

Each rank reads only what it holds: `ckpt_shards.unit_chunks` describes this rank's own boxes
of every full tensor (its ZeRO shard of its tp/ep slice of its stages, as views of its fp32
master buffers), and safetensors reads exactly such a box from the file
(`safe_open(...).get_slice(name)[box]`, a memory-mapped read of those bytes). So a rank's
reads total its share of the model (plus the copy of a tied head a last pipeline stage holds),
and the whole model is never materialised on one rank. The compute parameters are then
rebuilt from the masters as after a checkpoint load (`refresh_from_masters`), with the
optimizer at step 0 and zero moments.

Names: `hpctrain.models.hf_config.hf_weight_name`; a tied head (`tie_word_embeddings`) that
the files do not hold reads the embedding.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from hpctrain.models.hf_config import hf_weight_name
from hpctrain.parallel.data.state import refresh_from_masters
from hpctrain.parallel.state import ParallelState
from hpctrain.train.ckpt_shards import Chunk, optimizer_flats, unit_chunks

INDEX = "model.safetensors.index.json"


def safe_open_or_explain():
    """safetensors' `safe_open`; a ValueError naming the extra to install when missing."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ValueError("model.init_from reads safetensors, which is not installed: "
                         "pip install 'hpctrain[hf]'") from None
    return safe_open


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Hugging Face weight name → the safetensors file holding it: from the index of a
    sharded directory, else from the headers of every `*.safetensors` file."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.init_from={directory} holds no *.safetensors file: save the "
                         "model with save_pretrained(..., safe_serialization=True)")
    safe_open = safe_open_or_explain()
    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def _source(name: str, files: dict[str, Path], directory: Path) -> str:
    hf = hf_weight_name(name)
    if hf == "lm_head.weight" and hf not in files:
        hf = "model.embed_tokens.weight"  # tied: the head is the embedding
    if hf not in files:
        raise ValueError(f"model.init_from={directory} has no tensor {hf!r} (hpctrain's "
                         f"{name}): is it a complete Llama-family model directory?")
    return hf


@torch.no_grad()
def _read_box(f, hf: str, chunk: Chunk, directory: Path) -> int:
    """Read `chunk`'s box of tensor `hf` from open file `f` into `chunk.data`; bytes read."""
    piece = f.get_slice(hf)
    shape = tuple(piece.get_shape())
    if shape != chunk.size:
        raise ValueError(f"model.init_from={directory}: {hf} has shape {list(shape)}, but "
                         f"the model built from its config.json needs {list(chunk.size)}")
    box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
    values = piece[box]
    chunk.data.copy_(values.to(chunk.data.dtype))
    return values.numel() * values.element_size()


def load_hf_weights(directory: str | Path, *, parallel: ParallelState) -> int:
    """Collective (over each flat unit's group, as a checkpoint load): fill this rank's master
    weights from `directory`'s safetensors and refresh the compute parameters. Returns the
    bytes this rank read (its share)."""
    directory = Path(directory)
    files = weight_files(directory)
    safe_open = safe_open_or_explain()
    chunks = [c for c in unit_chunks(parallel, optimizer_flats(parallel), copies=True)
              if c.path[0] == "model"]
    read = 0
    with contextlib.ExitStack() as stack:
        opened = {}
        for chunk in chunks:
            hf = _source(chunk.path[1], files, directory)
            if files[hf] not in opened:
                opened[files[hf]] = stack.enter_context(safe_open(files[hf], framework="pt"))
            read += _read_box(opened[files[hf]], hf, chunk, directory)
    refresh_from_masters(parallel.engine, steps=0)
    return read

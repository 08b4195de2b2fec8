"""Initial weights from a Hugging Face model directory (`model.init_from`), read per rank.

Each rank reads only what it holds: `ckpt_shards.unit_chunks` describes this rank's own boxes
of every full tensor (its ZeRO shard of its tp/ep slice of its stages, as views of its fp32
master buffers), and safetensors reads exactly such a box from the file
(`safe_open(...).get_slice(name)[box]`, a memory-mapped read of those bytes). So a rank's
reads total its share of the model (plus the copy of a tied head a last pipeline stage holds),
and the whole model is never materialised on one rank. The compute parameters are then
rebuilt from the masters as after a checkpoint load (`refresh_from_masters`), with the
optimizer at step 0 and zero moments.

Names: `hpctrain.models.llama.hf_names`; a tied head (`tie_word_embeddings`) that the files do not
hold reads the embedding. A box of a stacked routed-expert weight [E, in, out] is read as the
matching [out, in] box of each of its experts' tensors, transposed.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from hpctrain.checkpoint.shards import Chunk, optimizer_flats, unit_chunks
from hpctrain.models.llama.hf_names import TIED_SOURCE, expert_stack, hf_expert_name, hf_weight_name
from hpctrain.parallel.data.state import refresh_from_masters
from hpctrain.parallel.state import ParallelState

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


def hf_sources(name: str, files: dict[str, Path], directory: Path, *,
             experts: int) -> list[str]:
    """The Hugging Face tensors holding hpctrain weight `name`: one, or one per expert."""
    stack = expert_stack(name)
    names = ([hf_expert_name(stack[0], e, stack[1]) for e in range(experts)] if stack
             else [hf_weight_name(name)])
    if names == ["lm_head.weight"] and names[0] not in files:
        names = [TIED_SOURCE]  # tied: the head is the embedding
    for hf in names:
        if hf not in files:
            raise ValueError(f"model.init_from={directory} has no tensor {hf!r} (hpctrain's "
                             f"{name}): is it a complete model directory of its family?")
    return names


def _slice(f, hf: str, want: tuple[int, ...], box: tuple[slice, ...], directory: Path):
    piece = f.get_slice(hf)
    shape = tuple(piece.get_shape())
    if shape != want:
        raise ValueError(f"model.init_from={directory}: {hf} has shape {list(shape)}, but "
                         f"the model built from its config.json needs {list(want)}")
    return piece[box]


@torch.no_grad()
def _read_box(opened, names: list[str], chunk: Chunk, directory: Path) -> int:
    """Read `chunk`'s box of the tensor held by `names` (open files by name) into
    `chunk.data`; bytes read."""
    box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
    if len(names) == 1 and expert_stack(chunk.path[1]) is None:
        values = [_slice(opened(names[0]), names[0], chunk.size, box, directory)]
        chunk.data.copy_(values[0])  # converts as it copies: no full-size temporary
    else:  # experts box[0] of [E, in, out]: each expert's [out, in] box, transposed
        want = (chunk.size[2], chunk.size[1])
        values = [_slice(opened(names[e]), names[e], want, (box[2], box[1]), directory)
                  for e in range(box[0].start, box[0].stop)]
        for row, v in zip(chunk.data, values, strict=True):
            row.copy_(v.t())
    return sum(v.numel() * v.element_size() for v in values)


def load_hf_weights(directory: str | Path, *, parallel: ParallelState, experts: int = 0) -> int:
    """Collective (over each flat unit's group, as a checkpoint load): fill this rank's master
    weights from `directory`'s safetensors and refresh the compute parameters. Returns the
    bytes this rank read (its share). `experts`: routed experts per MoE layer (model.moe)."""
    directory = Path(directory)
    files = weight_files(directory)
    safe_open = safe_open_or_explain()
    chunks = [c for c in unit_chunks(parallel, optimizer_flats(parallel), copies=True)
              if c.path[0] == "model"]
    read = 0
    with contextlib.ExitStack() as stack:
        handles = {}

        def opened(hf: str):
            if files[hf] not in handles:
                handles[files[hf]] = stack.enter_context(safe_open(files[hf], framework="pt"))
            return handles[files[hf]]

        for chunk in chunks:
            names = hf_sources(chunk.path[1], files, directory, experts=experts)
            read += _read_box(opened, names, chunk, directory)
    refresh_from_masters(parallel.engine, steps=0)
    return read

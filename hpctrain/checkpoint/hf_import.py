"""Initial weights from a Hugging Face model directory (`model.init_from`), read per rank.

Each rank reads only what it holds: `ckpt_shards.unit_chunks` describes this rank's own boxes
of every full tensor (its ZeRO shard of its tp/ep slice of its stages, as views of its fp32
master buffers), and safetensors reads exactly such a box from the file
(`safe_open(...).get_slice(name)[box]`, a memory-mapped read of those bytes). So a rank's
reads total its share of the model (plus the copy of a tied head a last pipeline stage holds),
and the whole model is never materialised on one rank. The compute parameters are then
rebuilt from the masters as after a checkpoint load (`refresh_from_masters`), with the
optimizer at step 0 and zero moments.

Where each box is read from is the family's (`hpctrain.models.llama.hf_names.hf_pieces`): a
renamed tensor's same box, a tied head's embedding, each expert's transposed box of a stacked
routed-expert weight.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from hpctrain.checkpoint.shards import Chunk, optimizer_flats, unit_chunks
from hpctrain.errors import read_json
from hpctrain.models.llama.hf_names import Piece, hf_pieces, whole
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
        weight_map = read_json(index, fix="download the model directory again")["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.init_from={directory} holds no *.safetensors file: save the "
                         "model with save_pretrained(..., safe_serialization=True)")
    safe_open = safe_open_or_explain()
    out = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                out.update(dict.fromkeys(f.keys(), path))
        except Exception as err:  # noqa: BLE001 - safetensors' errors are not one type
            raise ValueError(f"model.init_from={directory}: {path.name} is not a readable "
                             f"safetensors file ({err}): download it again") from None
    return out


def hf_sources(name: str, shape: tuple[int, ...], box: tuple[slice, ...],
               files: dict[str, Path], directory: Path) -> list[Piece]:
    """The pieces of the Hugging Face tensors holding box `box` of hpctrain weight `name`
    (the family's `hf_pieces`); ValueError naming the first tensor of the whole weight the
    directory lacks (every rank names the same one, whatever box it reads)."""
    for piece in hf_pieces(name, shape, whole(shape), holds=files.__contains__):
        if piece.hf not in files:
            raise ValueError(f"model.init_from={directory} has no tensor {piece.hf!r} (hpctrain's "
                             f"{name}): is it a complete model directory of its family?")
    return hf_pieces(name, shape, box, holds=files.__contains__)


def read_piece(f, piece: Piece, directory: Path) -> torch.Tensor:
    """`piece`'s box of its tensor in the open file `f`, after checking the tensor's shape."""
    view = f.get_slice(piece.hf)
    found = tuple(view.get_shape())
    if found != piece.shape:
        raise ValueError(f"model.init_from={directory}: {piece.hf} has shape {list(found)}, but "
                         f"the model built from its config.json needs {list(piece.shape)}")
    return view[piece.box]


@torch.no_grad()
def place(target: torch.Tensor, piece: Piece, value: torch.Tensor) -> None:
    """Copy a piece's value into the weight's box `target` (converting as it copies: no
    full-size temporary); an expert's row transposed."""
    if piece.row is None:
        target.copy_(value)
    else:
        target[piece.row].copy_(value.t())


def _read_chunk(opened, chunk: Chunk, files: dict[str, Path], directory: Path) -> int:
    """Read `chunk`'s box of its weight into `chunk.data`; bytes read."""
    box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
    read = 0
    for piece in hf_sources(chunk.path[1], chunk.size, box, files, directory):
        value = read_piece(opened(piece.hf), piece, directory)
        place(chunk.data, piece, value)
        read += value.numel() * value.element_size()
    return read


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
        handles = {}

        def opened(hf: str):
            if files[hf] not in handles:
                handles[files[hf]] = stack.enter_context(safe_open(files[hf], framework="pt"))
            return handles[files[hf]]

        for chunk in chunks:
            read += _read_chunk(opened, chunk, files, directory)
    refresh_from_masters(parallel.engine, steps=0)
    return read

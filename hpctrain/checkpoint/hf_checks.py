"""A Hugging Face model directory checked against its own config.json before any rank starts.

`model.init_from`'s config.json gives the model's shape (hpctrain.models.llama.hf_config); the
safetensors must hold exactly that model. Tensor by tensor, on the launching process:

- every file the index names exists and is a readable safetensors file (a missing shard or a
  truncated download is named, not a traceback inside the ranks);
- every tensor the model reads is present with the shape the config implies (a tied head may
  be absent: it is the embedding);
- every tensor present is read by the model: a tensor the config does not account for (a third
  layer's in a two-layer config, an o_proj bias) means config and weights disagree, and
  training on part of a model would be silently wrong;
- every value is finite: a NaN or infinity would surface later as a diverging loss or an empty
  generation. This reads the whole model once, one tensor at a time (its largest tensor is the
  memory it takes); `model.init_from` is checked so before training, evaluation and generation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hpctrain.checkpoint.hf_import import INDEX, safe_open_or_explain, weight_files
from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.models import family_of
from hpctrain.models.config import ModelConfig
from hpctrain.models.llama.hf_names import TIED_SOURCE, hf_pieces, whole

# Tensors transformers itself writes beside the weights and never reads back as parameters.
IGNORED = ("rotary_emb.inv_freq",)


@check("model.init_from", stage="input")
def check_init_from(c: Config) -> list[str]:
    """model.init_from holds exactly the model its config.json describes (module docstring)."""
    if not c.model.init_from:
        return []
    return directory_problems(c.model.init_from, c.model)


def expected_tensors(shape: ModelConfig, present) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name → full shape, of every tensor the model of `shape` reads from
    a directory holding the names `present` (a tied head reads the embedding)."""
    with torch.device("meta"):
        model = family_of(shape).build(shape, None)
    out: dict[str, tuple[int, ...]] = {}
    for name, meta in model.state_dict().items():
        size = tuple(meta.shape)
        for piece in hf_pieces(name, size, whole(size), holds=present.__contains__):
            out[piece.hf] = piece.shape
    return out


def directory_problems(directory: str | Path, shape: ModelConfig) -> list[str]:
    """The ways `directory`'s safetensors differ from the model `shape` (module docstring)."""
    where = f"model.init_from={directory}"
    try:
        files = weight_files(directory)
    except (ValueError, OSError) as err:
        return [str(err)]
    gone = sorted({p.name for p in files.values() if not p.is_file()})
    if gone:
        return [f"{where}: {INDEX} names {gone[0]}, which is missing: copy or download the "
                "directory whole (every file of its index)"]
    headers, problems = _headers(files, where)
    if problems:
        return problems
    expected = expected_tensors(shape, headers)
    missing = [n for n in expected if n not in headers]
    if missing:
        return [f"{where} has no tensor {missing[0]!r} ({len(missing)} missing), which its "
                "config.json implies: is it a complete model directory of its family?"]
    extra = sorted(n for n in headers if n not in expected and not n.endswith(IGNORED)
                   and not (n == TIED_SOURCE and shape.tied_embeddings))
    if extra:
        return [f"{where} holds {len(extra)} tensor(s) its config.json does not account for, "
                f"e.g. {extra[0]!r}: the model built from config.json would ignore them; fix "
                "config.json (layers, biases, tied embeddings) or remove them"]
    wrong = [(n, headers[n], s) for n, s in expected.items() if tuple(headers[n]) != s]
    if wrong:
        n, found, want = wrong[0]
        return [f"{where}: {n} has shape {list(found)}, but the model built from its "
                f"config.json needs {list(want)}"]
    return _nonfinite(files, expected, where)


def _headers(files: dict[str, Path], where: str) -> tuple[dict[str, list[int]], list[str]]:
    safe_open = safe_open_or_explain()
    shapes: dict[str, list[int]] = {}
    for path in sorted(set(files.values())):
        try:
            with safe_open(path, framework="pt") as f:
                shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})  # noqa: SIM118
        except Exception as err:  # noqa: BLE001 - safetensors' errors are not one type
            return {}, [f"{where}: {path.name} is not a readable safetensors file ({err}): "
                        "download it again"]
    absent = sorted(n for n, p in files.items() if n not in shapes)
    if absent:
        return {}, [f"{where}: {INDEX} puts {absent[0]!r} in {files[absent[0]].name}, which "
                    "does not hold it: download the directory again"]
    return shapes, []


def _nonfinite(files: dict[str, Path], expected, where: str) -> list[str]:
    safe_open = safe_open_or_explain()
    bad = []
    for path in sorted({files[n] for n in expected}):
        try:
            with safe_open(path, framework="pt") as f:
                for name in (n for n in f.keys() if n in expected):  # noqa: SIM118
                    value = f.get_tensor(name)
                    if value.is_floating_point() and not torch.isfinite(value).all():
                        count = int((~torch.isfinite(value)).sum())
                        bad.append(f"{name} ({count} of {value.numel()} values)")
        except Exception as err:  # noqa: BLE001 - a truncated file fails only when read
            return [f"{where}: {path.name} cannot be read ({err}): download it again"]
    if bad:
        return [f"{where}: non-finite weights (NaN or infinity) in {len(bad)} tensor(s): "
                f"{'; '.join(bad[:3])}: the directory is damaged or was saved from a diverged "
                "model; use another"]
    return []

"""`task=export`: a checkpoint of any layout as a Hugging Face model directory.

One process, no ranks: the newest verified checkpoint of a run directory (or the checkpoint
directory given) is verified (`ckpt_catalog.verify`: manifest, sizes, sha256), then its
`model.<name>` masters are read as full tensors through hpctrain's safe DCP reader (any dp/tp/
pp/ep/ZeRO layout: DCP chunks carry their offsets in the full tensor). The directory written:

  config.json                              the checkpoint's model shape (`hf_config.hf_config`)
  model-0000N-of-0000M.safetensors         weights renamed (`hf_names`), in export.dtype,
  model.safetensors.index.json             files of at most export.max_shard_mb each
  tokenizer files                          copied when the run's data used a Hugging Face
                                           tokenizer directory (data.tokenizer_path)

This holds the full model in host memory once (4 bytes per parameter, plus the cast), as
transformers' own save_pretrained does.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from hpctrain.checkpoint import catalog, safe_load
from hpctrain.checkpoint.hf_import import INDEX, safe_open_or_explain
from hpctrain.checkpoint.manifest import Unverified, Verified
from hpctrain.checkpoint.planners import ChunkLoadPlanner
from hpctrain.checkpoint.shards import Chunk
from hpctrain.config.build import build
from hpctrain.models.config import ModelConfig
from hpctrain.models.llama.hf_config import export_family, hf_config
from hpctrain.models.llama.hf_names import hf_tensors
from hpctrain.models.registry import family_of

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")


def find_checkpoint(source: str | Path, *, key: str = "export.from") -> Verified:
    """A checkpoint directory (verified) or a run directory's newest verified checkpoint;
    ValueError naming `key` (the setting that gave `source`) when there is none."""
    return newest_checkpoint(source, key=key)[0]


def newest_checkpoint(source: str | Path, *, key: str = "export.from"
                      ) -> tuple[Verified, list[tuple[Path, str]]]:
    """`find_checkpoint`, and the newer checkpoints of a run directory that did not verify,
    each with its reason (what an export of the run must say it passed over)."""
    source = Path(source)
    try:
        if (source / "manifest.json").is_file():
            return catalog.verify(source), []
        found, skipped = catalog.scan(source)
    except Unverified as err:
        raise ValueError(f"{key}={source} does not verify: {err}") from None
    if found is None:
        why = f" ({'; '.join(f'{p.name}: {r}' for p, r in skipped)})" if skipped else ""
        raise ValueError(f"{key}={source} holds no verified checkpoint{why}: give a run "
                         "directory with checkpoints/ or a checkpoints/step_XXXXXXXX directory")
    return found, skipped


def read_full_model(path: Path) -> dict[str, torch.Tensor]:
    """Every `model.<name>` of the checkpoint at `path` as a full tensor, by hpctrain name."""
    metadata = safe_load.read_metadata(path)
    chunks = [Chunk(("model", key[len("model."):]), tuple(md.size), (0,) * len(md.size),
                    torch.empty(tuple(md.size), dtype=md.properties.dtype))
              for key, md in metadata.state_dict_metadata.items() if key.startswith("model.")]
    with warnings.catch_warnings():  # one process by design: DCP warns it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({}, storage_reader=safe_load.SafeReader(str(path)),
                 planner=ChunkLoadPlanner(chunks), no_dist=True)
    return {c.path[1]: c.data for c in chunks}


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of at most `limit` bytes (a larger tensor alone), in name order."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > limit:
            out.append({})
            size = 0
        out[-1][name] = t
        size += n
    return out


def write_weights(tensors: dict[str, torch.Tensor], out: Path, *, limit: int) -> list[str]:
    """model-0000N-of-0000M.safetensors files and their index; returns the file names."""
    from safetensors.torch import save_file

    shards = _shards(tensors, limit)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards, strict=True):
        save_file({k: v.contiguous() for k, v in shard.items()}, str(out / file),
                  metadata={"format": "pt"})
        _as_umask_allows(out / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": weight_map}, indent=2))
    return names


def _as_umask_allows(path: Path) -> None:
    """The permissions of a file created with open() (safetensors writes 0600: a model
    shared on a cluster's file system would be unreadable to everyone else)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def run_tokenizer_dir(run_dir: Path) -> Path | None:
    """The run's data.tokenizer_path when it is a directory (a Hugging Face tokenizer)."""
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        return None
    from omegaconf import OmegaConf

    path = OmegaConf.load(saved).get("data", {}).get("tokenizer_path")
    return Path(path) if path and Path(path).is_dir() else None


def _exportable(found: Verified) -> ModelConfig:
    """The checkpoint's model, if a Hugging Face family holds it; else a ValueError."""
    saved = found.manifest.get("model")
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {found.path} records no model shape (written by an older "
                         "hpctrain): resume it once with this version and export that checkpoint")
    model = build(ModelConfig, "model", saved)
    _, why = export_family(model)
    if why:
        raise ValueError(f"checkpoint {found.path} holds a model no Hugging Face family "
                         f"holds exactly: {'; '.join(why)}")
    return model


def export_hf(settings, *, run_dir: Path | None = None) -> dict[str, Any]:
    """Write the Hugging Face directory `settings.out` (module docstring); returns a summary."""
    safe_open_or_explain()  # the extra is installed
    found, skipped = newest_checkpoint(settings.from_)
    model = _exportable(found)
    dtype = DTYPES[settings.dtype]
    full = read_full_model(found.path)
    if model.tied_embeddings:
        full.pop(f"{family_of(model).head}.weight", None)  # transformers ties lm_head to it
    tensors = {hf: piece.to(dtype) for name, t in sorted(full.items())
               for hf, piece in hf_tensors(name, t).items()}
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(model, dtype=settings.dtype),
                                                indent=2))
    files = write_weights(tensors, out, limit=int(settings.max_shard_mb * 2**20))
    copied = []
    tok = run_tokenizer_dir(run_dir or found.path.parent.parent)
    for name in TOKENIZER_FILES if tok is not None else ():
        if (tok / name).is_file():
            shutil.copy2(tok / name, out / name)
            copied.append(name)
    return {"checkpoint": str(found.path), "step": found.step, "out": str(out), "files": files,
            "tokenizer_files": copied, "skipped": [[str(p), why] for p, why in skipped],
            "parameters": sum(t.numel() for t in tensors.values())}


def export_summary(result: dict[str, Any]) -> str:
    """What task=export prints: the checkpoint exported, where, and every newer checkpoint it
    passed over because it did not verify."""
    lines = [f"exported {result['checkpoint']} (step {result['step']}, "
             f"{result['parameters']:,} parameters) to {result['out']}: "
             f"{len(result['files'])} safetensors file(s)"
             + (f", tokenizer {', '.join(result['tokenizer_files'])}"
                if result["tokenizer_files"] else "")]
    lines += [f"warning: skipped the newer {path}: {why}" for path, why in result["skipped"]]
    return "\n".join(lines)

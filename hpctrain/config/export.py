"""`export.*` (task=export) and `train.export_every`: the settings and their checks, apart from
the exporter so that validation and the schema read them without importing torch's checkpoint
reader."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpctrain.config.build import build
from hpctrain.config.rule import check, errors_of
from hpctrain.config.schema import Config
from hpctrain.models.llama.hf_config import export_family


@dataclass(frozen=True)
class ExportConfig:
    """`export.*` (task=export). `from_` is the key `export.from` (config.config_key)."""

    from_: str | None = None  # a run directory (its newest verified checkpoint) or checkpoint
    out: str | None = None  # the Hugging Face directory to write (created)
    dtype: Literal["bf16", "fp32"] = "bf16"
    max_shard_mb: float = 5000.0  # the largest safetensors file, as save_pretrained's 5 GB


def export_settings(extra: dict[str, Any]):
    """The `export` group as an ExportConfig; ValueError naming a missing `from`/`out`."""
    settings = build(ExportConfig, "export", extra.get("export") or {})
    missing = [k for k, v in (("from", settings.from_), ("out", settings.out))
               if v in (None, "???")]
    if missing:
        raise ValueError(f"task=export needs {' and '.join(f'export.{k}' for k in missing)}: "
                         "e.g. task=export export.from=outputs/run1 export.out=hf/run1")
    out = Path(settings.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"export.out={settings.out} is a file: name the directory to write "
                         f"(created), e.g. export.out={out.with_suffix('')}_hf")
    return settings


@check("export")
def check_export(c: Config) -> list[str]:
    """task=export: export.from and export.out are given, export.* keys known and typed."""
    return errors_of(c, lambda cfg: export_settings(cfg.extra))


@check("train.export_every", "train.keep_every", "train.checkpoint_every", "model.")
def check_export_every(c: Config) -> list[str]:
    """train.export_every: kept checkpoints exist at its multiples, the model has a Hugging
    Face form, and safetensors is installed (hpctrain.train.exports)."""
    t, errs = c.train, []
    if not t.export_every:
        return []
    if not t.keep_every or t.export_every % t.keep_every:
        errs.append(f"train.export_every={t.export_every} is not a multiple of train.keep_every"
                    f"={t.keep_every}: exports read checkpoints kept for good (retention could "
                    f"delete another during its export): set train.keep_every={t.export_every}")
    if not t.checkpoint_every or t.export_every % t.checkpoint_every:
        errs.append(f"train.export_every={t.export_every} is not a multiple of "
                    f"train.checkpoint_every={t.checkpoint_every}, so no checkpoint is saved at "
                    f"its steps: set train.checkpoint_every to a divisor of {t.export_every}")
    family, why = export_family(c.model)
    if why:
        errs.append(f"train.export_every={t.export_every}: model {c.model.name} has no exact "
                    f"Hugging Face form ({'; '.join(why)}): set train.export_every=0")
    if importlib.util.find_spec("safetensors") is None:
        errs.append(f"train.export_every={t.export_every} writes safetensors, which is not "
                    "installed: pip install 'hpctrain[hf]'")
    return errs

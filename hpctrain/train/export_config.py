"""`export.*` (task=export): the settings, apart from the exporter so that validation and the
schema read them without importing torch's checkpoint reader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hpctrain.config_build import build


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
    return settings

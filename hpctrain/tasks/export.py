"""task=export: a checkpoint of any layout as a Hugging Face model directory
(hpctrain.checkpoint.hf_export), once, with no ranks."""

from __future__ import annotations

from typing import Any

from hpctrain.checkpoint.hf_export import export_hf
from hpctrain.config.export import export_settings
from hpctrain.config.schema import Config


def run_export(cfg: Config) -> dict[str, Any]:
    return export_hf(export_settings(cfg.extra))

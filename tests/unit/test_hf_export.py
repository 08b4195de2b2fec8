"""task=export's refusals: what is missing is named before anything is read."""

from __future__ import annotations

import pytest

from hpctrain.dispatch import launch
from tests.conftest import make_config


def test_export_needs_from_and_out(tmp_path):
    with pytest.raises(ValueError, match=r"task=export needs export.from and export.out"):
        make_config(["task=export"], run_dir=tmp_path)


def test_export_of_a_run_without_checkpoints_says_so(tmp_path):
    pytest.importorskip("safetensors")
    cfg = make_config(["task=export", f"export.from={tmp_path}", f"export.out={tmp_path / 'o'}"],
                      run_dir=tmp_path)
    assert cfg.extra["export"]["from"] == str(tmp_path)
    with pytest.raises(ValueError, match="holds no verified checkpoint"):
        launch(cfg)


def test_the_runs_hf_tokenizer_directory_is_found(tmp_path):
    from hpctrain.checkpoint.hf_export import run_tokenizer_dir

    (tmp_path / "tok").mkdir()
    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    saved = tmp_path / "run" / ".hydra" / "config.yaml"
    saved.write_text(f"data:\n  tokenizer_path: {tmp_path / 'tok'}\n")
    assert run_tokenizer_dir(tmp_path / "run") == tmp_path / "tok"
    saved.write_text("data:\n  tokenizer_path: null\n")  # a built-in tokenizer: nothing to copy
    assert run_tokenizer_dir(tmp_path / "run") is None

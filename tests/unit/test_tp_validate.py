"""Configuration errors for tensor parallelism name the values and the fix."""

from __future__ import annotations

import pytest

from tests.conftest import make_config

BASE = ["model=debug", "train=debug", "logger.wandb=disabled", "cluster.procs_per_node=4",
        "parallel.tp=4"]


@pytest.mark.parametrize("overrides, match", [
    (["model.n_heads=2", "model.n_kv_heads=2"],
     r"model.n_heads=2 is not divisible by parallel.tp=4: choose tp among the divisors"),
    (["model.n_kv_heads=3", "model.n_heads=12", "model.dim=48"],
     r"model.n_kv_heads=3 and parallel.tp=4: kv heads must be divisible by tp"),
    (["model.vocab_size=510"], r"model.vocab_size=510 is not divisible by parallel.tp=4: pad"),
    (["model.ffn_dim=98"], r"model.ffn_dim=98 is not divisible by parallel.tp=4: choose"),
    (["parallel.sp=true", "train.seq_len=62"],
     r"train.seq_len=62 is not divisible by parallel.tp=4.*multiple of tp or set parallel.sp"),
])
def test_tp_shape_errors(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        make_config(BASE + overrides, run_dir=tmp_path)


def test_tp_and_sp_accepted(tmp_path):
    cfg = make_config(BASE + ["parallel.sp=true"], run_dir=tmp_path)
    assert cfg.parallel.tp == 4 and cfg.parallel.sp


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_tp_accepted(zero, tmp_path):
    assert make_config(BASE + [f"parallel.zero={zero}"], run_dir=tmp_path).parallel.zero == zero


PP = ["model=debug", "train=debug", "logger.wandb=disabled", "cluster.procs_per_node=4",
      "parallel.pp=2", "parallel.dp=2", "train.global_batch_size=8"]


def test_zero_with_pp_accepted_up_to_stage_2(tmp_path):
    assert make_config(PP + ["parallel.zero=2"], run_dir=tmp_path).parallel.zero == 2


def test_zero3_with_pp_is_refused_and_offload_accepted(tmp_path):
    with pytest.raises(ValueError, match=r"parallel.zero=3 with parallel.pp=2 .* use "
                                         r"parallel.zero=1 or 2"):
        make_config(PP + ["parallel.zero=3"], run_dir=tmp_path)
    cfg = make_config(PP + ["parallel.zero=1", "parallel.offload=cpu",
                            "parallel.grad_comm_dtype=bf16"], run_dir=tmp_path)
    assert (cfg.parallel.offload, cfg.parallel.grad_comm_dtype) == ("cpu", "bf16")

"""Pipeline configuration: presets compose, pp and virtual_stages are accepted, mistakes named."""

import pytest

from tests.conftest import make_config

PP2 = ["parallel=pp2", "cluster.procs_per_node=2", "model=debug", "train=debug"]


def test_pp2_preset_and_default_schedule():
    cfg = make_config(PP2)
    assert cfg.parallel.pp == 2 and cfg.parallel.schedule == "1f1b" and not cfg.parallel.timeline


def test_interleaved_and_zbv_accepted():
    make_config([*PP2, "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2",
                 "train.global_batch_size=8"])
    make_config([*PP2, "parallel.schedule=zbv", "train.global_batch_size=8"])


def test_3d_preset_is_accepted_with_and_without_sp():
    base = ["parallel=3d", "cluster.procs_per_node=8", "model=debug", "train=debug",
            "train.global_batch_size=8"]
    cfg = make_config(base)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (2, 2, 2)
    assert make_config([*base, "parallel.sp=true"]).parallel.sp


@pytest.mark.parametrize("overrides,match", [
    (["parallel.schedule=nope"], "parallel.schedule='nope' is not one of"),
    (["parallel.schedule=zb_h1", "train.global_batch_size=2"], "microbatches"),
    (["parallel.virtual_stages=2"], "interleaved_1f1b"),
    (["model.n_layers=6", "parallel.schedule=zbv"], "not divisible by the 4 pipeline stages"),
])
def test_pipeline_mistakes_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_config([*PP2, *overrides])


def test_timeline_needs_pp():
    with pytest.raises(ValueError, match="parallel.timeline"):
        make_config(["parallel.timeline=true"])


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_accepted_with_pp(mode):
    assert make_config([*PP2, f"train.activation_checkpointing={mode}"]).parallel.pp == 2


def test_zero3_with_pp_refusal_says_why_and_what_to_use():
    with pytest.raises(ValueError, match=r"all-gathers of the whole stage per step.*zero=1 or 2"):
        make_config([*PP2, "parallel.zero=3"])

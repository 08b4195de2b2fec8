"""No silent minutes and plain pictures: the lines before the model build and the first step say
what to expect; training.png's throughput axis starts at 0."""

from __future__ import annotations

import dataclasses

from hpctrain.train.phases import build_note, first_step_note
from tests.conftest import make_config


def test_slow_first_steps_are_announced(tmp_path):
    fp8 = make_config(["model=debug", "train=debug", "train.precision=bf16", "train.fp8=true",
                       "train.compile=blocks"], run_dir=tmp_path)
    note = first_step_note(fp8, device_type="cpu", start=4)
    assert note.startswith("training steps 5..10 of train.steps=10; the first step can be slow")
    assert "train.compile=blocks compiles first" in note and "train.fp8 on a CPU" in note
    assert "train.fp8" not in first_step_note(fp8, device_type="cuda", start=0)
    big = make_config(["model=llama3_8b", "plan.force=true"], run_dir=tmp_path)  # 8B on a CPU
    assert build_note(big, device_type="cpu").endswith("this can take minutes on a CPU")
    assert "GB of fp32 weights" in build_note(big, device_type="cuda")
    assert first_step_note(make_config(["model=debug", "train=debug"], run_dir=tmp_path),
                           device_type="cpu", start=0) == "training steps 1..10 of train.steps=10"


def test_eager_ring_blocks_on_an_accelerator_are_announced(tmp_path):
    """Under cp the eager and sdpa blocks form each block's scores on a GPU: the build line
    says so with their size and the backends that keep them on chip; nothing on a CPU or with
    a fused block backend."""
    over = ["model=debug", "train=debug", "parallel=cp2", "cluster.procs_per_node=2"]
    cfg = make_config(over, run_dir=tmp_path)  # seq_len 64: chunks of 16, 4 heads, 2 rows
    note = build_note(cfg, device_type="cuda")
    assert ("; under parallel.cp=2 model.attention=sdpa runs each ring block's eager math on "
            "cuda, forming its fp32 scores") in note
    expected_gb = cfg.train.micro_batch_size * cfg.model.n_heads * 16 * 16 * 4 / 1e9
    assert f"({expected_gb:.3g} GB per block at 16 tokens a chunk)" in note
    assert "parallel.cp" not in build_note(cfg, device_type="cpu")
    for fused in ("flash", "flex", "triton"):  # not validated: each needs its own device here
        other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=fused))
        assert "parallel.cp" not in build_note(other, device_type="cuda")


def test_throughput_axis_starts_at_zero():
    from hpctrain.metrics.plot import draw_run

    records = [{"step": s, "loss": 3.0, "tokens_per_s": 1000.0 + s} for s in range(1, 6)]
    assert draw_run(records).axes[1].get_ylim()[0] == 0
    assert draw_run([]) is None

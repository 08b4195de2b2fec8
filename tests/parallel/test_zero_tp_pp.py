"""ZeRO composed with tensor and pipeline parallelism.

tp=2 × dp=2 with zero ∈ {0, 1, 2, 3} (and 1, 3 with sp):
fp64 parameters after 3 clipped AdamW steps equal the
single-process run's slices to 1e-12 (the clip is active, so the norm's replica division is
exercised). Trainers, fp32: pp=2 × dp=2 with zero ∈ {1, 2} (parameters to 1e-5 and the
loss trajectory) and 3D (2×2×2) zero=1 (loss trajectory to 1e-5 relative, grad norm to 1e-4);
every pair of ZeRO, offload, tp, sp and pp: tests/parallel/test_compat_matrix.py.
A checkpoint saved at tp=2 × dp=2 zero=1 resumes at tp=1 × dp=2 zero=2. bf16 gradient
communication with tp=2 or pp=2 (× dp=2) follows the single process.
"""

from __future__ import annotations

import pytest

from hpctrain.checkpoint import save_load as ckpt
from tests.conftest import get_world
from tests.parallel import zero_tp_helpers as z
from tests.parallel.trainer_runs import logged_trajectory, train_in_world


@pytest.mark.parametrize("zero, sp", [(0, False), (1, False), (2, False), (3, False),
                                      (1, True), (3, True)])
def test_tp2_dp2_zero_matches_single_process(world4, zero, sp):
    for err, norms, ref_norms in world4.run(z.tp_dp_zero_errors, zero, 3, sp=sp):
        assert err < 1e-12, err
        assert norms == pytest.approx(ref_norms, rel=1e-12)
        assert min(norms) > z.CLIP  # clipping was active on every step


def _close(got, want, *, rel_norm=1e-4):
    assert len(got) == len(want)
    for (loss, norm), (loss1, norm1) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss1, rel=1e-5)
        assert norm == pytest.approx(norm1, rel=rel_norm)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return get_world(1).run(z.train_params, [], str(tmp_path_factory.mktemp("ref")))[0]


@pytest.mark.parametrize("zero", [1, 2])
def test_pp2_dp2_zero_trainer_matches_single_process(world4, tmp_path, reference, zero):
    runs = world4.run(z.train_params, ["parallel.pp=2", "parallel.dp=2", f"parallel.zero={zero}",
                                       "parallel.schedule=1f1b"], str(tmp_path / "pp"))
    _close(logged_trajectory([r[0] for r in runs]), reference[0])
    ref_params = reference[1]
    seen = set()
    for _, params in runs:
        for name, value in params.items():
            assert float((value - ref_params[name]).abs().max()) < 1e-5, name
            seen.add(name)
    assert seen == set(ref_params)  # the two stages together hold the whole model


@pytest.mark.parametrize("layout", [
    ["parallel.pp=2", "parallel.zero=1", "parallel.schedule=1f1b",
     "parallel.grad_comm_dtype=bf16"],
    ["parallel.tp=2", "parallel.zero=1", "parallel.grad_comm_dtype=bf16"],
], ids=["pp2_bf16_comm", "tp2_bf16_comm"])
def test_low_precision_grad_comm_with_tp_or_pp(world4, tmp_path, reference, layout):
    """× dp=2: bf16 gradient communication (fp32 accumulation) within bf16's rounding of the
    reduced gradients (optimizer offload with tp and pp: tests/parallel/test_compat_matrix)."""
    runs = world4.run(z.train_params, [*layout, "parallel.dp=2"], str(tmp_path / "run"))
    got = logged_trajectory([r[0] for r in runs])
    for (loss, norm), (loss1, norm1) in zip(got, reference[0], strict=True):  # measured: loss
        # 2.0e-6, norm 5.0e-4 relative (the norm is of the bf16-rounded reduced gradients)
        assert loss == pytest.approx(loss1, rel=2e-5) and norm == pytest.approx(norm1, rel=5e-3)
    assert got != reference[0]  # the gradients did travel in bf16


def test_3d_zero1_trainer_matches_single_process(world8, tmp_path):
    ref = get_world(1).run(train_in_world, [], str(tmp_path / "ref"))[0]
    runs = world8.run(train_in_world, ["parallel=3d", "parallel.zero=1"], str(tmp_path / "3d"))
    _close(logged_trajectory(runs), ref)


def test_tp2_dp2_zero1_checkpoint_resumes_at_dp2_zero2(world4, world2, tmp_path):
    ref = get_world(1).run(train_in_world, [], str(tmp_path / "ref"))[0]
    saved = tmp_path / "saved"
    world4.run(train_in_world, ["parallel.tp=2", "parallel.dp=2", "parallel.zero=1",
                                "train.stop_after=2"], str(saved))
    path = ckpt.latest_complete(saved)
    assert path is not None and path.name.endswith("00000002")
    runs = world2.run(train_in_world, ["parallel.dp=2", "parallel.zero=2",
                                       f"train.resume={path}"], str(tmp_path / "resumed"))
    _close(runs[0], ref[2:])

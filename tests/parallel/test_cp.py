"""Context parallelism (parallel.cp): ring attention over zigzag shards equals one process.

fp64 (1e-12): cp ∈ {2, 4}, loss and every gradient, with and without documents (and then
padding targets spread unevenly over the shards), eager and sdpa per-block forwards, ring and
all-gather transports; cp=2 with hpctrain's Triton kernels as the blocks (interpreter), and
with full / selective activation checkpointing. Zigzag balance: equal computed blocks per rank.
Trainer (fp32): cp=2 (also with full recompute), cp=2 × dp=2 with ZeRO-1/3, cp=2 × tp=2
(± sp), cp=2 × pp=2 (1f1b, zb_h1) trajectories, resume cp=2 → cp=1 and back, and
comm_cp_bytes equal to the analytical volume.
"""

from __future__ import annotations

import pytest

from tests.parallel import cp_helpers as h


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("documents", [False, True])
def test_cp2_loss_and_grads_equal_single_fp64(world2, attention, documents):
    for r in world2.run(h.cp_equals_single, attention, documents):
        assert r["loss_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("documents", [False, True])
def test_cp4_loss_and_grads_equal_single_fp64(world4, attention, documents):
    for r in world4.run(h.cp_equals_single, attention, documents):
        assert r["loss_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r


@pytest.mark.parametrize("documents", [False, True])
def test_cp2_triton_kernel_blocks_equal_single_fp64(world2, documents):
    """model.attention=triton: every block (diagonal: causal; earlier key chunk: not, with
    rows that see none of it) is hpctrain's kernel, forward and backward, under Triton's
    interpreter."""
    for r in world2.run(h.cp_triton_equals_single, documents):
        assert r["loss_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r
        assert r["blocks"] > 0


@pytest.mark.parametrize("documents", [False, True])
def test_allgather_transport_equals_single_fp64(world4, documents):
    for r in world4.run(h.cp_equals_single, "sdpa", documents, transport="allgather"):
        assert r["loss_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_cp2_activation_checkpointing_equals_single_fp64(world2, checkpointing):
    """Full recompute reruns each layer's ring forward in backward (cp − 1 more shards sent
    per layer); selective leaves ring attention as it is (nothing more sent)."""
    for r in world2.run(h.cp_equals_single, "eager", True, checkpointing=checkpointing):
        assert r["loss_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r
        assert r["bytes"] == 2 * h.ring_bytes(batch=2, kv_heads=2, shard_len=16, head_dim=8,
                                              elem_bytes=8, cp=2, recompute=checkpointing)


@pytest.mark.parametrize("cp,documents", [(2, True), (4, False)])
def test_cp_moe_routes_every_shard_and_its_router_losses_equal_single_fp64(world2, world4, cp,
                                                                           documents):
    """Routed experts in every block (aux and z coefficients 0.5, 0.1): each cp rank routes its
    tokens, the load-balancing and z losses come from statistics summed over cp (their
    gradients through the all-reduce's backward): loss and every gradient equal one process's
    (router and experts included)."""
    world = world2 if cp == 2 else world4
    for r in world.run(h.cp_equals_single, "eager", documents, experts=4):
        assert r["loss_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r


def test_zigzag_balances_the_blocks_each_rank_computes(world4):
    """Without documents every cp rank computes 2·cp + 1 chunk blocks per layer."""
    blocks = [r["blocks"] for r in world4.run(h.cp_equals_single, "eager", False)]
    assert blocks == [2 * (2 * 4 + 1)] * 4  # 2 layers


def _same_trajectory(got: list[dict], want: list[dict], *, eval_rows: bool = True) -> None:
    """fp32: losses (and eval losses) to 1e-5, grad norms to 1e-4, relative. Eval losses
    only with `eval_rows` (dp = 1: the single process's eval reads the same rows)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
        assert (g["eval_loss"] is None) == (w["eval_loss"] is None)
        if eval_rows and w["eval_loss"] is not None:
            assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    from tests.conftest import get_world

    return get_world(1).run(h.train_cp, [], str(tmp_path_factory.mktemp("single")))[0]


@pytest.mark.parametrize(("transport", "recompute"),
                         [("ring", "none"), ("allgather", "none"), ("ring", "full")])
def test_cp2_trainer_matches_single_process(world2, tmp_path, single, transport, recompute):
    runs = world2.run(h.train_cp, ["parallel.cp=2", f"parallel.cp_comm={transport}",
                                   f"train.activation_checkpointing={recompute}"],
                      str(tmp_path / "cp2"))
    _same_trajectory(runs[0], single)
    for rank in runs:  # every rank sends exactly the analytical ring volume, every step
        assert [s["comm_cp_bytes"] for s in rank] == [s["expected_cp_bytes"] for s in rank]
        assert rank[0]["expected_cp_bytes"] > 0


@pytest.mark.parametrize("zero", [1, 3])
def test_cp2_dp2_zero_trainer_matches_single_process(world4, tmp_path, single, zero):
    runs = world4.run(h.train_cp, ["parallel.cp=2", "parallel.dp=2", f"parallel.zero={zero}"],
                      str(tmp_path / f"cp2dp2z{zero}"))
    _same_trajectory(runs[0], single, eval_rows=False)


@pytest.mark.parametrize("sp", [False, True])
def test_cp2_tp2_trainer_matches_single_process(world4, tmp_path, single, sp):
    runs = world4.run(h.train_cp, ["parallel.cp=2", "parallel.tp=2", f"parallel.sp={sp}"],
                      str(tmp_path / f"cp2tp2sp{sp}"))
    _same_trajectory(runs[0], single)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_cp2_pp2_trainer_matches_single_process(world4, tmp_path, single, schedule):
    runs = world4.run(h.train_cp, ["parallel.cp=2", "parallel.pp=2",
                                   f"parallel.schedule={schedule}"], str(tmp_path / schedule))
    _same_trajectory(next(r for r in runs if r[0]["loss"] == r[0]["loss"]), single)


def test_cp2_checkpoint_resumes_at_cp1(world2, tmp_path, single):
    from hpctrain.checkpoint import save_load as ckpt
    from tests.conftest import get_world

    saved = tmp_path / "saved"
    world2.run(h.train_cp, ["parallel.cp=2", "train.stop_after=2"], str(saved))
    path = ckpt.latest_complete(saved)
    assert path is not None and path.name.endswith("00000002")
    runs = get_world(1).run(h.train_cp, [f"train.resume={path}"], str(tmp_path / "resumed"))
    _same_trajectory(runs[0], single[2:])


def test_cp1_checkpoint_resumes_at_cp2(world2, tmp_path, single):
    from hpctrain.checkpoint import save_load as ckpt
    from tests.conftest import get_world

    saved = tmp_path / "saved"
    get_world(1).run(h.train_cp, ["train.stop_after=2"], str(saved))
    path = ckpt.latest_complete(saved)
    assert path is not None and path.name.endswith("00000002")
    runs = world2.run(h.train_cp, ["parallel.cp=2", f"train.resume={path}"],
                      str(tmp_path / "resumed"))
    _same_trajectory(runs[0], single[2:])


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """train.batching=tokens on documents of uneven length: rows end in padding, so the zigzag
    shards of a row hold different numbers of real tokens (some none); and its single-process
    trajectory."""
    from tests.conftest import get_world

    root = tmp_path_factory.mktemp("padded")
    (root / "src").mkdir()
    for i in range(60):
        text = f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 7)
        (root / "src" / f"d{i:02d}.txt").write_text(text)
    overrides = ["train.batching=tokens", "data=files", f"data.paths=[{root}/src/*.txt]",
                 f"data.cache_dir={root / 'cache'}", "data.val_fraction=0.2"]
    single_run = get_world(1).run(h.train_cp, overrides, str(root / "single"))[0]
    assert any(s["padding_fraction"] > 0.05 for s in single_run)  # padding is exercised
    return overrides, single_run


@pytest.mark.parametrize(("ranks", "extra"), [(2, []), (4, ["parallel.pp=2"])],
                         ids=["cp2", "cp2pp2"])
def test_cp2_on_padded_rows_matches_single_process(tmp_path, padded, ranks, extra):
    """The step's loss is the mean over real tokens whatever the shards hold: each shard's
    mean is weighted by its real tokens over dp×cp (a row-level rescale on top of that
    weighting counted the shards twice)."""
    from tests.conftest import get_world

    overrides, want = padded
    runs = get_world(ranks).run(h.train_cp, [*overrides, "parallel.cp=2", *extra],
                                str(tmp_path / "run"))
    _same_trajectory(next(r for r in runs if r[0]["loss"] == r[0]["loss"]), want)

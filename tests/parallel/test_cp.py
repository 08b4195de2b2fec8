"""Context parallelism (parallel.cp): ring attention over zigzag shards equals one process."""

from __future__ import annotations

import pytest

from tests.parallel import cp_helpers as h


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("documents", [False, True])
def test_cp2_loss_and_grads_equal_single_fp64(world2, attention, documents):
    for r in world2.run(h.cp_equals_single, attention, documents):
        assert r["loss_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r


@pytest.mark.parametrize("documents", [False, True])
def test_cp4_loss_and_grads_equal_single_fp64(world4, documents):
    for r in world4.run(h.cp_equals_single, "eager", documents):
        assert r["loss_err"] <= 1e-12 and r["grad_err"] <= 1e-12, r


def test_zigzag_balances_the_blocks_each_rank_computes(world4):
    """Without documents every cp rank computes 2·cp + 1 chunk blocks per layer."""
    blocks = [r["blocks"] for r in world4.run(h.cp_equals_single, "eager", False)]
    assert blocks == [2 * (2 * 4 + 1)] * 4  # 2 layers

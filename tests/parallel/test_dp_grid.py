"""DDP and ZeRO-1/2/3 over dp ranks reproduce the single-process run.

fp64: 1e-12 (measured ~5e-17). fp32: 1e-5 (measured ~3e-7; the dp run sums gradients in
another order). Adam's eps is 1e-4 in these tests (see dp_helpers.OPTIM).
"""

import pytest
import torch

from tests.parallel import dp_helpers as h

GRID = [(z, a) for z in (0, 1, 2, 3) for a in (1, 2)]


@pytest.mark.parametrize("zero,accum", GRID)
def test_dp2_matches_single_process_fp64(world2, zero, accum):
    errs = world2.run(h.compare_with_reference, 3, zero=zero, accum=accum, dtype=torch.float64)
    assert max(errs) < 1e-12, errs


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_dp2_matches_single_process_fp32(world2, zero):
    errs = world2.run(h.compare_with_reference, 3, zero=zero, accum=2)
    assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("zero,accum", GRID)
def test_dp4_matches_single_process_fp64(world4, zero, accum):
    errs = world4.run(h.compare_with_reference, 2, zero=zero, accum=accum, dtype=torch.float64)
    assert max(errs) < 1e-12, errs

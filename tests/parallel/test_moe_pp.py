"""MoE blocks inside pipeline stages: each stage seeds its own router losses (aux + z) with
the micro-batch's loss weight, so pp alone is exact in fp64 (loss, every gradient, the
per-layer router losses) and ep=2 × pp=2 follows the single-process trajectory in fp32 with
the same logged aux/z metrics, for 1f1b and the zero-bubble W split (sharing the worlds)."""

from __future__ import annotations

import pytest

from tests.parallel import moe_pp_helpers as h


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pp2_moe_loss_gradients_and_router_losses_equal_single_process_fp64(world2, schedule):
    results = world2.run(h.pp_gradients, schedule)
    for loss_err, grad_err, router_err in results:
        assert loss_err < 1e-12 and grad_err < 1e-12 and router_err < 1e-12, \
            (loss_err, grad_err, router_err)


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_ep2_pp2_dp2_trajectory_and_router_metrics_equal_single_process_fp32(world4, schedule):
    for param_err, metric_err in world4.run(h.ep_pp_trajectory, schedule):
        assert param_err < 1e-5 and metric_err < 1e-6, (param_err, metric_err)

"""optim.lr_schedule (issue 24): each schedule at chosen steps equals its formula, worked by
hand (lr=1, min_lr=0.1, warmup=10)."""

from __future__ import annotations

import math

import pytest

from hpctrain.config.schema import OptimConfig
from hpctrain.train.optim import lr_at

BASE = dict(lr=1.0, min_lr=0.1, warmup_steps=10)
CASES = [  # schedule settings, total steps, {step: lr}
    (dict(lr_schedule="linear"), 110, {0: 0.1, 9: 1.0, 10: 1.0, 35: 0.775, 60: 0.55, 110: 0.1}),
    (dict(lr_schedule="cosine"), 110, {10: 1.0, 35: 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2,
                                       60: 0.55, 110: 0.1}),
    (dict(lr_schedule="constant"), 110, {4: 0.5, 10: 1.0, 109: 1.0}),
    (dict(lr_schedule="inv_sqrt"), 110, {0: 0.1, 9: 1.0, 10: 1.0, 40: 0.5, 1000: 0.1}),
    (dict(lr_schedule="wsd", decay_fraction=0.2, decay_shape="linear"), 100,
     {9: 1.0, 50: 1.0, 80: 1.0, 85: 0.775, 90: 0.55, 100: 0.1}),
    (dict(lr_schedule="wsd", decay_fraction=0.2, decay_shape="cosine"), 100,
     {79: 1.0, 85: 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 90: 0.55, 100: 0.1}),
    (dict(lr_schedule="wsd", decay_fraction=0.2, decay_shape="1-sqrt"), 100,
     {79: 1.0, 85: 0.55, 96: 0.1 + 0.9 * (1 - math.sqrt(0.8)), 100: 0.1, 120: 0.1}),
]


IDS = [f"{k['lr_schedule']}-{k.get('decay_shape', '')}" for k, _, _ in CASES]


@pytest.mark.parametrize("kw,total,expected", CASES, ids=IDS)
def test_schedule_equals_its_formula(kw, total, expected):
    o = OptimConfig(**BASE, **kw)
    got = {step: lr_at(step, o, total_steps=total) for step in expected}
    assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("kind", ["linear", "cosine", "wsd", "inv_sqrt"])
def test_after_warmup_the_lr_never_rises(kind):
    o = OptimConfig(**BASE, lr_schedule=kind)
    values = [lr_at(s, o, total_steps=200) for s in range(10, 260)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))

"""FlatUnit.adopt_grad keeps every p.grad a view of the unit's bucket: a gradient autograd left in
its own tensor is copied in once; one already in place is left alone (no view, no copy), which
the per-micro-batch hook relies on to stay cheap."""

import torch

from hpctrain.parallel.data.units import FlatUnit


def _unit(dtype: torch.dtype) -> FlatUnit:
    torch.manual_seed(0)
    named = [(f"p{i}", torch.nn.Parameter(torch.randn(*shape)))
             for i, shape in enumerate([(3, 5), (7,), (2, 2, 3)])]
    return FlatUnit(0, named, dp=1, rank=0, zero=0, dtype=dtype, group=None)


def _in_bucket(unit: FlatUnit, i: int) -> bool:
    o, n = unit.layout.offsets[i], unit.layout.numels[i]
    return unit.params[i].grad.data_ptr() == unit.grad_full[o : o + n].data_ptr()


def test_adopt_copies_a_fresh_gradient_once_and_leaves_views_alone():
    for dtype in (torch.float32, torch.bfloat16):  # element sizes 4 and 2: slice addresses
        unit = _unit(dtype)
        unit.zero_grad()  # lazy: p.grad dropped, the next gradient is copied over its slice
        fresh = [torch.randn(p.shape).to(dtype) for p in unit.params]
        for p, g in zip(unit.params, fresh, strict=True):
            p.grad = g.clone()
        for i in range(len(unit.params)):
            unit.adopt_grad(i)
            assert _in_bucket(unit, i)
            assert torch.equal(unit.params[i].grad, fresh[i])
        held = [p.grad for p in unit.params]
        unit.grad_full.add_(1)  # what autograd's in-place accumulation into the views does
        for i in range(len(unit.params)):
            unit.adopt_grad(i)  # already in place: the same tensor object, values kept
            assert unit.params[i].grad is held[i]
            assert torch.equal(unit.params[i].grad, fresh[i] + 1)

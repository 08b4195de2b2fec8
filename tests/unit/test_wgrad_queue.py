"""WeightGradQueue files deferred weight gradients per tag; running one tag leaves the rest."""

import torch

from hpctrain.ops.linear import Linear, WeightGradQueue


def test_queue_runs_per_tag_and_matches_plain_backward():
    torch.manual_seed(0)
    lin = Linear(3, 2)
    xs = [torch.randn(4, 3, requires_grad=True) for _ in range(2)]
    expected = sum(lin(x).square().sum() for x in xs)
    expected.backward()
    want = lin.weight.grad.clone()
    lin.weight.grad = None
    queue = WeightGradQueue()
    lin.wgrad_queue = queue
    outs = [lin(x).square().sum() for x in xs]
    queue.deferring = True
    for tag, out in enumerate(outs):
        queue.tag = tag
        out.backward()
    queue.deferring = False
    assert lin.weight.grad is None and len(queue) == 2 and queue.pending(1) == 1
    assert queue.run(0) == 1 and queue.pending(0) == 0 and len(queue) == 1
    assert queue.run_all() == 1
    torch.testing.assert_close(lin.weight.grad, want)
    assert not lin.weight.grad.requires_grad  # deferred closures run outside autograd

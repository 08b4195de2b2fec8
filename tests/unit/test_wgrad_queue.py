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


def _grads(fn, x, lin):
    lin.weight.grad = None
    x = x.detach().requires_grad_()
    y = fn(x)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape))
    return y.grad_fn, x.grad, lin.weight.grad


def test_linear_takes_torchs_node_unless_a_queue_may_defer():
    """Without a queue the layer is torch's linear; with a queue that may defer, the hook path
    (torch's node over a detached weight + a hook on y that computes the weight gradient) —
    both give LinearFunction's gradients, deferring or not; under saved-tensor hooks
    (activation checkpointing) or when a cast is due, LinearFunction itself."""
    from torch.utils.checkpoint import checkpoint

    from hpctrain.ops.linear import LinearFunction

    torch.manual_seed(0)
    lin = Linear(5, 3).double()
    x = torch.randn(2, 4, 5, dtype=torch.float64)
    _, want_x, want_w = _grads(lambda t: LinearFunction.apply(t, lin.weight, None, None), x, lin)
    node, gx, gw = _grads(lin, x, lin)
    assert "LinearFunction" not in node.name()
    torch.testing.assert_close(gx, want_x, rtol=1e-12, atol=0)
    torch.testing.assert_close(gw, want_w, rtol=1e-12, atol=0)
    lin.wgrad_queue = queue = WeightGradQueue()
    for deferring in (False, True):
        queue.deferring, queue.tag = deferring, 0
        node, gx, gw = _grads(lin, x, lin)
        queue.deferring = False
        assert "LinearFunction" not in node.name()
        assert (gw is None) == deferring and len(queue) == int(deferring)
        queue.run_all()
        torch.testing.assert_close(gx, want_x, rtol=1e-12, atol=0)
        torch.testing.assert_close(lin.weight.grad, want_w, rtol=1e-12, atol=0)
    node, *_ = _grads(lambda t: checkpoint(lin, t, use_reentrant=False), x, lin)
    assert "LinearFunction" in node.name()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 compute dtype: a cast is due
        assert "LinearFunction" in lin(x.detach().requires_grad_()).grad_fn.name()
    lin.wgrad_queue.may_defer = False
    assert "LinearFunction" not in _grads(lin, x, lin)[0].name()


def test_runtime_lets_only_split_backward_stages_defer():
    """The pipeline runtime marks a stage's queue `may_defer` only when its action list has B
    actions (zero-bubble schedules); 1F1B's stages take torch's linear."""
    from hpctrain.models.config import ModelConfig
    from hpctrain.parallel.pipeline.lowering import lower_comm
    from hpctrain.parallel.pipeline.runtime import PipelineRuntime
    from hpctrain.parallel.pipeline.schedules import build_schedule
    from hpctrain.parallel.pipeline.stage import build_local_stages
    from hpctrain.parallel.step import lm_loss

    cfg = ModelConfig(name="debug", vocab_size=32, dim=8, n_layers=2, n_heads=2, n_kv_heads=1,
                      ffn_dim=16, max_seq_len=4, attention="eager")
    for name, want in (("1f1b", False), ("zb_h1", True)):
        schedule = build_schedule(name, pp=2, microbatches=2, virtual_stages=1)
        local, _ = build_local_stages(cfg, schedule.stages_of(0), n_stages=2, seed=0,
                                      tp_group=None)  # no torch.distributed here
        PipelineRuntime(lower_comm(schedule), local, pp_rank=0, peers=[0, 1],
                        act_shape=(1, 4, 8), loss_fn=lm_loss)
        assert [s.wgrad_queue.may_defer for s in local.stages.values()] == [want], name


def test_linear_function_casts_only_when_dtypes_differ():
    """Same dtypes, no autocast: LinearFunction saves x and W themselves (no cast copies) and
    matches F.linear exactly; under bf16 autocast, or with a bf16 input and an fp32 weight, it
    computes and saves in bf16 and returns the weight gradient in the weight's dtype."""
    from hpctrain.ops.linear import LinearFunction

    torch.manual_seed(0)
    w = torch.randn(3, 5, requires_grad=True)
    x = torch.randn(2, 4, 5, requires_grad=True)
    y = LinearFunction.apply(x, w, None, None)
    assert [t.data_ptr() for t in y.grad_fn.saved_tensors] == [x.data_ptr(), w.data_ptr()]
    y.sum().backward()
    want = torch.nn.functional.linear(x, w)
    gx, gw = torch.autograd.grad(want.sum(), (x, w))
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close((x.grad, w.grad), (gx, gw), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_autocast = LinearFunction.apply(x, w, None, None)
    x16 = x.detach().bfloat16().requires_grad_()
    for y16 in (y_autocast, LinearFunction.apply(x16, w, None, None)):
        assert y16.dtype == torch.bfloat16
        assert {t.dtype for t in y16.grad_fn.saved_tensors} == {torch.bfloat16}
        w.grad = None
        y16.float().sum().backward()
        assert w.grad.dtype == torch.float32

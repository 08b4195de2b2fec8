"""The flash backend's block of ring attention (parallel/context/flash_block.py) on CPU.

flash-attn runs only on CUDA; tests/gpu runs the real kernels. Here its two varlen entry points
are replaced by `FakeVarlen`, which computes what flash-attn documents for them (segments from
cu_seqlens, causal masks aligned to the bottom right, lse (N, T) in fp32 and +inf on rows with
no key, the backward's D from its `out`, dk/dv summed over a kv head's query heads) and checks
the preconditions its C++ checks (int32 offsets, head dims a multiple of 8, contiguous last
dims, max_seqlen bounds). So what is tested is hpctrain's side: the segments, the layouts, the
padding and the lse conventions, against the eager block in fp64.
"""

from __future__ import annotations

import math

import pytest
import torch

from hpctrain.parallel.context import flash_block
from hpctrain.parallel.context.blocks import block_backward, block_forward
from tests.parallel.cp_helpers import ring_blocks


class FakeVarlen:
    """flash-attn's `_wrapped_flash_attn_varlen_forward/backward`, in the inputs' dtype."""

    def __init__(self):
        self.calls = 0

    @staticmethod
    def _checks(q, k, cu_q, cu_k, max_q, max_k):
        assert cu_q.dtype == cu_k.dtype == torch.int32
        assert q.shape[-1] % 8 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
        assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0]
        lens_q, lens_k = cu_q.diff(), cu_k.diff()
        assert (lens_q >= 0).all() and (lens_k >= 0).all()
        assert max_q >= max(int(lens_q.max()), 2) and max_k >= int(lens_k.max())
        return [(int(a), int(b), int(c), int(d)) for a, b, c, d in
                zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True)]

    @staticmethod
    def _probs(q, k, scale, causal, lse=None):
        """(p (N, Lq, Lk), lse (N, Lq)) of one segment: p against `lse` when given."""
        s = torch.einsum("qnh,knh->nqk", q, k.repeat_interleave(q.shape[1] // k.shape[1], 1))
        s = s * scale
        if causal:  # bottom-right aligned: query i sees keys up to i + Lk − Lq
            Lq, Lk = q.shape[0], k.shape[0]
            seen = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)
            s = s.masked_fill(~seen, -math.inf)
        own = torch.logsumexp(s, -1)
        ref = own if lse is None else lse
        return torch.exp(s - torch.where(ref.isinf(), 0, ref)[..., None]), own

    def forward(self, *, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                dropout_p, softmax_scale, causal):
        self.calls += 1
        assert dropout_p == 0.0
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=q.dtype)
        for q0, q1, k0, k1 in self._checks(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k):
            if q1 == q0 or k1 == k0:
                continue
            p, own = self._probs(q[q0:q1], k[k0:k1], softmax_scale, causal)
            groups = q.shape[1] // k.shape[1]
            out[q0:q1] = torch.einsum("nqk,knh->qnh", p, v[k0:k1].repeat_interleave(groups, 1))
            lse[:, q0:q1] = own
        return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)

    def backward(self, *, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                 cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                 rng_state):
        self.calls += 1
        assert (window_size_left, window_size_right, softcap, alibi_slopes) == (-1, -1, 0.0, None)
        assert softmax_lse.shape == (q.shape[1], q.shape[0]) and dout.stride(-1) == 1
        groups = q.shape[1] // k.shape[1]
        d = (dout * out).sum(-1).T  # N × T: the kernel's own D
        for q0, q1, k0, k1 in self._checks(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k):
            if q1 == q0 or k1 == k0:
                continue
            p, _ = self._probs(q[q0:q1], k[k0:k1], softmax_scale, causal,
                               softmax_lse[:, q0:q1])
            ke, ve = (x[k0:k1].repeat_interleave(groups, 1) for x in (k, v))
            do = dout[q0:q1]
            dp = torch.einsum("qnh,knh->nqk", do, ve)
            ds = p * (dp - d[:, q0:q1, None]) * softmax_scale
            dq[q0:q1] = torch.einsum("nqk,knh->qnh", ds, ke)
            fold = (k1 - k0, k.shape[1], groups, k.shape[2])
            dk[k0:k1] = torch.einsum("nqk,qnh->knh", ds, q[q0:q1]).reshape(fold).sum(2)
            dv[k0:k1] = torch.einsum("nqk,qnh->knh", p, do).reshape(fold).sum(2)
        return d


@pytest.fixture
def fake(monkeypatch):
    kernels = FakeVarlen()
    monkeypatch.setattr(flash_block, "_kernels", lambda: (kernels.forward, kernels.backward))
    return kernels


def _implied_mask(block):
    """The B×C×C mask that flash_block.segments' varlen segments mean (causal bottom-right)."""
    cu_q, cu_k, _ = flash_block.segments(block)
    B, C = block.ids_q_BC.shape
    mask = torch.zeros(B * C, B * C, dtype=torch.bool)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        Lq, Lk = int(q1 - q0), int(k1 - k0)
        seen = torch.ones(Lq, Lk, dtype=torch.bool)
        if block.diagonal:
            seen = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)
        mask[q0:q1, k0:k1] = seen
    rows = [mask[b * C:(b + 1) * C, b * C:(b + 1) * C] for b in range(B)]
    assert int(mask.sum()) == sum(int(r.sum()) for r in rows)  # no segment crosses rows
    return torch.stack(rows)


@pytest.mark.parametrize("cp", [2, 4])
def test_segments_mean_exactly_the_blocks_mask(cp):
    """Every block of random packings (one document, few, many; documents across chunks):
    the varlen segments see exactly the causal same-document mask — no C×C mask is formed to
    find them, and the rows they give no key are the rows the mask empties."""
    seen_empty_rows = False
    for seed in range(3):
        for block, *_ in ring_blocks(cp=cp, C=7, seed=seed):
            assert torch.equal(_implied_mask(block), block.mask_BCC)
            seen_empty_rows |= bool((~block.mask_BCC.any(-1)).any())
    assert seen_empty_rows


@pytest.mark.parametrize("head_dim", [8, 6])
def test_flash_block_follows_the_eager_block_fp64(fake, head_dim):
    """The block's forward (o, and lse with −inf on rows no key reaches) and its backward
    against the row's final O and lse equal the eager block's to 1e-12 on every block, with
    GQA; a head dim of 6 is zero-padded to the kernels' 8 and cut back."""
    for block, *tensors in ring_blocks():
        q, k, v, do, o, lse, d = (x[..., :head_dim] if x.dim() == 4 else x for x in tensors)
        d = (do * o).sum(-1)
        got_o, got_lse = flash_block.flash_block_forward(q, k, v, block)
        want_o, want_lse = block_forward(q, k, v, block)
        torch.testing.assert_close(got_o, want_o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)
        got = flash_block.flash_block_backward(q, k, v, block, do, o, lse, d)
        want = block_backward(q, k, v, block, do, o, lse, d)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert fake.calls > 0


def test_segments_are_built_once_per_micro_batch(fake, monkeypatch):
    """Every layer and the backward reuse a block's segments: one build (one host sync) per
    block of a micro-batch, however many calls."""
    builds = []
    build = flash_block._cache.build
    monkeypatch.setattr(flash_block._cache, "build", lambda b: builds.append(b) or build(b))
    block, q, k, v, do, o, lse, d = next(iter(ring_blocks(seed=5)))
    for _ in range(3):
        flash_block.flash_block_forward(q, k, v, block)
        flash_block.flash_block_backward(q, k, v, block, do, o, lse, d)
    assert len(builds) == 1


@pytest.mark.parametrize(("installed", "refused"), [
    ("2.6.3", True), ("2.7.0", False), ("2.8.3.post1", False), ("2.9.0", True), ("3.0.0b1", True),
])
def test_flash_attn_versions_outside_the_known_signatures_are_refused(monkeypatch, installed,
                                                                      refused):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    problem = flash_block.version_problem()
    assert (problem is not None) == refused
    if refused:
        assert f"this one is {installed}" in problem
        assert "pip install 'flash-attn>=2.7.0,<2.9'" in problem


def test_every_attention_backend_runs_its_own_blocks_under_cp():
    """No backend falls back to the eager block math under cp."""
    from hpctrain.ops.attention import ATTENTION_BACKENDS
    from hpctrain.parallel.context.backends import BLOCK_FUNCTIONS, block_functions

    assert set(BLOCK_FUNCTIONS) == set(ATTENTION_BACKENDS)
    assert block_functions("flash") == (flash_block.flash_block_forward,
                                        flash_block.flash_block_backward)
    with pytest.raises(ValueError, match="under parallel.cp use one of eager, sdpa"):
        block_functions("nope")

"""The fused attention backends on CUDA in bf16, against eager attention in fp32.

The same cases as tests/unit/test_attention_backends.py (GQA 1/2/4/MQA, no documents / many
documents with ones of length 1 / one document per row), at a length that is no multiple of any
tile and real head dims. bf16 cannot match fp32 to a fixed small tolerance, so each backend's
error (forward and dq, dk, dv) must stay within 2× (+1e-3) of sdpa's in the same bf16 —
the criterion flash-attn's own tests use. `flash` runs only where flash-attn is installed.
Skipped without a CUDA device; run with `python -m pytest tests/gpu` (TRITON_INTERPRET unset).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hpctrain import dispatch
from hpctrain.metrics.logger import read_jsonl
from hpctrain.ops.attention import ATTENTION_BACKENDS, eager_attention
from hpctrain.ops.documents import Documents
from tests.conftest import make_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

L = 1000
GQA = {"gqa1": (8, 8), "gqa2": (8, 4), "gqa4": (8, 2), "mqa": (8, 1)}
ROWS = [[1, 200, 1, 397, 400, 1], [1000]]
BACKENDS = ["triton"] + (["flash"] if importlib.util.find_spec("flash_attn") else [])
FULL = [(b, g, layout, h) for b in BACKENDS for g in GQA for layout in ("none", "docs")
        for h in (64, 128)]
# flex compiles one kernel per shape (~10 s each): a few cases cover its mask and GQA paths.
FLEX = [("flex", "gqa2", "none", 128), ("flex", "gqa2", "docs", 128), ("flex", "mqa", "docs", 64)]


def _docs(layout: str) -> Documents | None:
    if layout == "none":
        return None
    ids = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in ROWS]
    return Documents.from_ids(torch.stack(ids).cuda())


def _run(fn, q, k, v, docs, grad):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, docs)
    return [out.float(), *(g.float() for g in torch.autograd.grad(out, (q, k, v), grad))]


@pytest.mark.parametrize("backend,gqa,layout,head_dim", FULL + FLEX)
def test_backend_bf16_error_within_twice_sdpa(backend, gqa, layout, head_dim):
    N, K = GQA[gqa]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, L, n, head_dim, device="cuda", generator=gen).transpose(1, 2)
               for n in (N, K, K))
    grad = torch.randn(2, N, L, head_dim, device="cuda", generator=gen)
    docs = _docs(layout)
    ref = _run(eager_attention, q, k, v, docs, grad)
    bf16 = [x.bfloat16() for x in (q, k, v)]
    sdpa = _run(ATTENTION_BACKENDS["sdpa"], *bf16, docs, grad.bfloat16())
    got = _run(ATTENTION_BACKENDS[backend], *bf16, docs, grad.bfloat16())
    for name, r, s, g in zip(["out", "dq", "dk", "dv"], ref, sdpa, got, strict=True):
        bound = 2 * (s - r).abs().max().item() + 1e-3
        assert (g - r).abs().max().item() <= bound, (backend, name)


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_training_with_each_backend_tracks_sdpa(tmp_path, backend):
    """model=tiny: head dim 32 (flex needs ≥ 16)."""
    over = ["model=tiny", "train=debug", "train.steps=6", "train.eval_every=0",
            "logger.wandb=disabled", "data.max_bytes=300000", "cluster.device=cuda",
            "train.precision=bf16"]
    dispatch.run(make_config(over, run_dir=tmp_path / "sdpa"))
    dispatch.run(make_config([*over, f"model.attention={backend}"], run_dir=tmp_path / backend))
    ref = [r["loss"] for r in read_jsonl(tmp_path / "sdpa" / "metrics.jsonl")]
    got = [r["loss"] for r in read_jsonl(tmp_path / backend / "metrics.jsonl")]
    assert all(abs(a - b) < 0.02 * a for a, b in zip(ref, got, strict=True)), (ref, got)


def test_flex_ring_blocks_on_cuda_follow_the_eager_blocks():
    """Under cp, model.attention=flex runs each ring block through flex_attention (compiled)
    and its backward through flex's own with the lse gradient (parallel/context/flex_block.py):
    on CUDA in fp32, every block of random packings (documents, GQA, empty rows) matches the
    eager fp64 block, forward and backward (tf32-free fp32 kernels: 1e-4)."""
    from hpctrain.parallel.context.blocks import Block, block_backward, block_forward
    from hpctrain.parallel.context.flex_block import flex_block_backward, flex_block_forward
    from tests.parallel.cp_helpers import ring_blocks

    for block, *tensors in ring_blocks(C=128):
        on = Block(block.ids_q_BC.cuda(), block.ids_k_BC.cuda(), block.diagonal)
        cast = [x.cuda().float() for x in tensors]
        o, lse_b = flex_block_forward(*cast[:3], on)
        o1, lse1 = block_forward(*tensors[:3], block)
        torch.testing.assert_close(o.double().cpu(), o1, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse_b.double().cpu(), lse1, rtol=1e-4, atol=1e-4)
        got = flex_block_backward(*cast[:3], on, *cast[3:])
        want = block_backward(*tensors[:3], block, *tensors[3:])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double().cpu(), w, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not importlib.util.find_spec("flash_attn"), reason="needs flash-attn")
def test_flash_ring_blocks_on_cuda_follow_the_eager_blocks():
    """Under cp, model.attention=flash runs each ring block through flash-attn's varlen kernels
    (parallel/context/flash_block.py): in bf16 on every block of random packings (documents,
    GQA, empty rows), forward and backward against the row's final O and lse, its error to the
    fp64 eager block stays within 2× (+1e-3) of the eager block's own on the same bf16 inputs."""
    from hpctrain.parallel.context.blocks import Block, block_backward, block_forward
    from hpctrain.parallel.context.flash_block import flash_block_backward, flash_block_forward
    from tests.parallel.cp_helpers import ring_blocks

    for block, *tensors in ring_blocks(C=128):
        on = Block(block.ids_q_BC.cuda(), block.ids_k_BC.cuda(), block.diagonal)
        bf16 = [x.cuda().bfloat16() for x in tensors[:5]]  # q, k, v, dO, O
        bf16 += [tensors[5].cuda().float(), (bf16[3].float() * bf16[4].float()).sum(-1)]
        want = [*block_forward(*tensors[:3], block), *block_backward(*tensors[:3], block,
                                                                     *tensors[3:])]
        eager = [*block_forward(*bf16[:3], on), *block_backward(*bf16[:3], on, *bf16[3:])]
        got = [*flash_block_forward(*bf16[:3], on), *flash_block_backward(*bf16[:3], on,
                                                                          *bf16[3:])]
        for name, g, e, w in zip(["o", "lse", "dq", "dk", "dv"], got, eager, want, strict=True):
            assert g.shape == w.shape, name
            finite = w.isfinite()
            assert torch.equal(g.isfinite().cpu(), finite), name  # −inf lse on the same rows
            err = (g.double().cpu() - w)[finite].abs().max().item()  # e: rounded as g is
            bound = 2 * (e.to(g.dtype).double().cpu() - w)[finite].abs().max().item() + 1e-3
            assert err <= bound, (name, err, bound)

"""Every attention backend against the eager reference, forward and backward (dq, dk, dv).

Cases: GQA ratios 1, 2, 4 and MQA; L = 70 tokens (not a multiple of the Triton interpreter's
32-row tile nor of flex's 128 block); no documents, and a batch whose rows hold many documents
including ones of length 1 (first, middle, last) and one spanning tiles, ending inside the
last query tile (whose later rows must stay masked from it) | one document | two layouts
where the triton kernels skip the mask inside a document: forward/dq on row 2 (keys
32-63 for rows 64-69, in a document starting at 4), dk/dv on row 3 (rows 32-63 for keys 0-31,
in a document ending at 64 < L). Inputs have the model's layout (a transposed B L N H buffer).
All in fp64 to 1e-12 — triton too, under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 on machines without CUDA; its kernels accumulate in fp64 for fp64 inputs) —
plus triton in fp32, the dtype CPU training uses; flex forward only (no CPU backward).
flash-attn has no CPU kernels: its glue (flattening, cu_seqlens) runs against a stand-in module
that computes each sequence with eager attention.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

from hpctrain.ops.attention import ATTENTION_BACKENDS, eager_attention
from hpctrain.ops.attention_flash import flash_backend
from hpctrain.ops.documents import Documents
from tests.conftest import ROOT, make_config

L, H = 70, 16
GQA = {"gqa1": (4, 4), "gqa2": (4, 2), "gqa4": (8, 2), "mqa": (4, 1)}
ROWS = [[1, 3, 1, 62, 2, 1], [70], [1, 3, 66], [64, 6]]


def _docs(layout: str) -> Documents | None:
    if layout == "none":
        return None
    ids = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in ROWS]
    return Documents.from_ids(torch.stack(ids))


def _inputs(N: int, K: int, dtype: torch.dtype, *, head_dim: int = H, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    make = [torch.randn(len(ROWS), L, n, head_dim, generator=gen, dtype=dtype) for n in (N, K, K)]
    return [x.transpose(1, 2).requires_grad_() for x in make]  # B N L H views, as in the model


def _compare(backend: str, gqa: str, layout: str, dtype, tol: float, *, backward: bool = True,
             head_dim: int = H):
    N, K = GQA[gqa]
    q, k, v = _inputs(N, K, dtype, head_dim=head_dim)
    docs = _docs(layout)
    ref = eager_attention(*(x.double() for x in (q, k, v)), docs)
    with torch.set_grad_enabled(backward):
        out = ATTENTION_BACKENDS[backend](q, k, v, docs)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if not backward:
        return
    grad = torch.randn(ref.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.double())
    for name, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol, msg=f"d{name}")


CASES = [(g, layout) for g in GQA for layout in ("none", "docs")]
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
    reason="triton on CPU runs under its interpreter (pip install triton; tests/gpu on CUDA)")


@pytest.mark.parametrize("gqa,layout", CASES)
def test_sdpa_matches_eager_fp64(gqa, layout):
    _compare("sdpa", gqa, layout, torch.float64, 1e-12)


@pytest.mark.parametrize("gqa,layout", CASES)
def test_flex_forward_matches_eager_fp64(gqa, layout):
    _compare("flex", gqa, layout, torch.float64, 1e-12, backward=False)


@needs_interpreter
@pytest.mark.parametrize("gqa,layout", CASES)
def test_triton_matches_eager_fp64_interpreted(gqa, layout):
    _compare("triton", gqa, layout, torch.float64, 1e-12)


@needs_interpreter
def test_triton_fp32_and_a_small_head_dim():
    """fp32 as CPU training runs it; H = 8 is padded to the 16 lanes tl.dot needs and the
    padding never leaks into results."""
    _compare("triton", "gqa2", "docs", torch.float32, 2e-5, head_dim=8)


@needs_interpreter
def test_model_with_triton_on_packed_documents_equals_eager_fp64():
    """The debug model (head dim 8, padded inside the kernel) on rows packed with end-of-
    document tokens: logits and every parameter gradient as with eager attention."""
    from hpctrain.models import PRESETS, build_model

    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    tokens[0, [5, 6, 30]] = tokens[1, 40] = 256
    docs = Documents.from_eod(tokens, eod=256)
    runs = []
    for backend in ("eager", "triton"):
        model = build_model(PRESETS["debug"].with_(attention=backend), seed=0).double()
        logits = model(tokens, docs=docs)
        logits.logsumexp(-1).mean().backward()
        runs.append([logits.detach(), *(p.grad for p in model.parameters())])
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_tile_ranges_skip_invisible_tiles_and_unmask_fully_visible_ones():
    """Rows 0-2 doc 0, 3-9 doc 1, 10-11 doc 2; tiles of 4 rows and 2 keys (query side) and
    4 keys and 2 rows (key side). Query tile 2 (rows 8-11) spans docs 1 and 2: keys from 2
    (doc 1 starts at 3, rounded down), all masked. Query tile 1 (rows 4-7) lies in doc 1: keys
    4-7 are causally masked, 2-3 hold doc 0's last key, none is mask-free (doc 1 starts at 3,
    rounded up to 4 = the tile's first row). Key tile 1 (keys 4-7, in doc 1): queries 4-9 may
    see it, and rows 8-9 (a whole 2-row tile after key 7, inside doc 1) see all of it."""
    from hpctrain.ops.triton_attention import key_tile_ranges, query_tile_ranges

    ids = torch.tensor([[0] * 3 + [1] * 7 + [2] * 2, [0] * 12])
    assert query_tile_ranges(ids, bm=4, bn=2).tolist() == [
        [[0, 0, 0], [2, 4, 4], [2, 2, 2]],  # (lo, free_lo, free_hi) per query tile
        [[0, 0, 0], [0, 0, 4], [0, 0, 8]]]
    assert key_tile_ranges(ids, bm=2, bn=4).tolist() == [
        [[10, 10, 10], [8, 10, 10], [12, 12, 12]],  # (free_lo, free_hi, hi) per key tile
        [[4, 12, 12], [8, 12, 12], [12, 12, 12]]]


def test_per_batch_memo_rebuilds_for_a_new_or_changed_batch():
    from hpctrain.ops.documents_cache import LastDocuments

    built = []
    memo = LastDocuments(lambda d: built.append(d) or len(built))
    docs = _docs("docs")
    assert memo.get(docs) == memo.get(docs) == 1  # every layer of one forward: built once
    assert memo.get(_docs("docs")) == 2  # the next batch (another ids tensor)
    docs2 = Documents.from_ids(torch.zeros(1, 4, dtype=torch.long))
    memo.get(docs2)
    docs2.ids_BL[0, 3] = 1  # changed in place
    assert memo.get(docs2) == 4


COMPILE_FOR_H100 = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hpctrain.ops import triton_attention as ta, triton_attention_kernels as kern

for fn, name in ((kern.attn_fwd, "fwd"), (kern.attn_bwd_dq, "dq"), (kern.attn_bwd_dkdv, "dkdv")):
    for docs, causal in ((True, True), (False, True), (True, False)):
        ptrs = {n: "*fp32" if n in ("LSE", "DELTA") else "*i32" if n in ("IDS", "IDS_K", "RANGES")
                else "*bf16" for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "LSE",
                                       "DELTA", "IDS", "IDS_K", "RANGES")}
        sig = {p.name: "constexpr" if p.is_constexpr else ptrs.get(p.name, "i32")
               for p in fn.params}
        bm, bn = ta.GPU_TILES[name]
        consts = {"QK_SCALE2": 0.1275, "SM_SCALE": 0.0884, "HAS_DOCS": docs, "BM": bm,
                  "BN": bn, "HP": 128, "PREC": "tf32", "ACC": tl.float32, "CAUSAL": causal}
        consts = {k: v for k, v in consts.items() if k in sig}
        if not docs:
            sig["IDS"], consts["IDS"] = "constexpr", None
            sig["IDS_K"], consts["IDS_K"] = "constexpr", None
        warps, stages = ta.GPU_LAUNCH[name]
        k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
        assert k.metadata.shared <= 227 * 1024, (name, k.metadata.shared)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_kernels_compile_for_h100_without_a_gpu():
    """The GPU path, short of running: Triton compiles the three kernels in bf16 (with and
    without documents, causal or not (a context-parallel block), head dim 128, the launch's
    tiles and warps) to sm_90 machine code, with its bundled ptxas, in a process without the
    interpreter; shared memory fits (≤ 227 KiB)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100], env=env, timeout=300,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def _eager_rows(q_TNH, k_TKH, v_TKH):
    return eager_attention(*(x.transpose(0, 1)[None] for x in (q_TNH, k_TKH, v_TKH)))[0]


@pytest.fixture
def stand_in_flash(monkeypatch):
    """A flash_attn module computing with eager attention, one sequence per cu_seqlens span."""
    mod = types.ModuleType("flash_attn")

    def flash_attn_func(q_BLNH, k_BLKH, v_BLKH, *, causal):
        assert causal
        return eager_attention(*(x.transpose(1, 2) for x in (q_BLNH, k_BLKH, v_BLKH))) \
            .transpose(1, 2)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, *, causal):
        assert causal and torch.equal(cu_q, cu_k) and max_q == max_k == int(cu_q.diff().max())
        out = torch.empty_like(q)
        for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            out[s:e] = _eager_rows(q[s:e], k[s:e], v[s:e]).transpose(0, 1)
        return out

    mod.flash_attn_func, mod.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", mod)


@pytest.mark.parametrize("layout", ["none", "docs"])
def test_flash_glue_gives_each_document_its_own_sequence(stand_in_flash, layout):
    N, K = GQA["gqa2"]
    q, k, v = _inputs(N, K, torch.float64)
    docs = _docs(layout)
    torch.testing.assert_close(flash_backend(q, k, v, docs), eager_attention(q, k, v, docs),
                               rtol=0, atol=1e-12)


def test_flex_refuses_backward_on_cpu():
    q, k, v = _inputs(4, 2, torch.float32)
    with pytest.raises(ValueError, match="no backward on CPU"):
        ATTENTION_BACKENDS["flex"](q, k, v)


TRAIN = ["model=debug", "train=debug", "logger.wandb=disabled", "cluster.device=cpu"]


@pytest.mark.parametrize("backend,words", [
    ("flex", ["model.attention=flex has no backward on CPU", "model.attention=sdpa"]),
    ("flash", ["model.attention=flash", "hpctrain[flash]", "is cpu", "cluster.device=cuda"]),
])
def test_config_refuses_backends_the_device_cannot_train_with(backend, words):
    with pytest.raises(ValueError) as err:
        make_config([*TRAIN, f"model.attention={backend}"])
    for w in words:
        assert w in str(err.value)


@needs_interpreter
def test_config_needs_the_interpreter_for_triton_on_cpu(monkeypatch):
    make_config([*TRAIN, "model.attention=triton"])  # TRITON_INTERPRET=1 (conftest): accepted
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="start the process with TRITON_INTERPRET=1"):
        make_config([*TRAIN, "model.attention=triton"])

"""The cp axis: rank order, the dp×cp group, zigzag shards and validation (no processes)."""

from __future__ import annotations

import pytest
import torch

from hpctrain.distributed.dims import ParallelDims
from hpctrain.ops.documents import Documents
from hpctrain.parallel.context.shard import shard_documents, shard_rows, unshard_rows
from tests.conftest import make_config
from tests.parallel.cp_helpers import ring_blocks


def test_cp_sits_between_dp_and_tp():
    d = ParallelDims(dp=2, tp=2, pp=2, cp=2)
    assert d.world_size == 16
    assert d.coords(6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}
    assert d.group_ranks("tp", 6) == [6, 7]
    assert d.group_ranks("cp", 6) == [4, 6]
    assert d.group_ranks("dp", 6) == [2, 6]
    assert d.dp_cp_ranks(6) == [0, 2, 4, 6]
    assert sorted(r for g in d.all_of(d.dp_cp_ranks) for r in g) == list(range(16))
    assert ParallelDims(dp=2).dp_cp_ranks(1) == [0, 1]


def test_zigzag_shards_cover_the_row_once_with_full_row_positions():
    x_BL = torch.arange(16).view(1, 16)
    shards = [shard_rows(x_BL, rank=r, cp=2) for r in range(2)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert torch.equal(unshard_rows(shards), x_BL)
    docs = shard_documents(Documents.from_ids(torch.tensor([[0] * 5 + [1] * 11])), rank=1, cp=2)
    assert docs.positions_BL.tolist() == [[4, 0, 1, 2, 3, 4, 5, 6]]
    assert docs.ids_of(0).tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]


@pytest.mark.parametrize(("overrides", "text"), [
    (["train.seq_len=36", "parallel.cp=4"], "seq_len=36 is not divisible by 2 × parallel.cp=4"),
    (["parallel.cp=3"], "parallel.cp=3 × parallel.dp=1 = 3 ranks"),
])
def test_cp_mistakes_are_refused_with_the_fix(overrides, text, tmp_path):
    with pytest.raises(ValueError) as err:
        make_config(["model=debug", "train=debug", "cluster.procs_per_node=4", *overrides],
                    run_dir=tmp_path)
    assert text in str(err.value)




def test_flash_under_cp_is_checked_for_a_known_flash_attn(tmp_path, monkeypatch):
    """flash runs its own kernels inside the ring (tests/unit/test_cp_flash_block.py); the
    private entry points it calls are checked against the installed flash-attn before launch."""
    import dataclasses
    import importlib.metadata

    from hpctrain.config.validate.layout import check_cp

    cfg = make_config(["model=debug", "train=debug", "parallel=cp2", "cluster.procs_per_node=2"],
                      run_dir=tmp_path)
    flash = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="flash"))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.8.3")
    assert check_cp(flash) == []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.5.9")
    (err,) = check_cp(flash)
    assert err.startswith("model.attention=flash under parallel.cp runs flash-attn's varlen")


def test_flex_block_forward_equals_the_eager_block_fp64():
    """flex_attention's block (its BlockMask from the ids; the reference path in fp64 on CPU)
    gives the eager block's output and log-sum-exp, −inf on the rows its mask empties."""
    from hpctrain.parallel.context.blocks import block_forward
    from hpctrain.parallel.context.flex_block import flex_block_forward

    seen_empty_rows = False
    for block, q, k, v, *_ in ring_blocks():
        o, lse = flex_block_forward(q, k, v, block)
        o1, lse1 = block_forward(q, k, v, block)
        torch.testing.assert_close(o, o1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, lse1, rtol=1e-12, atol=1e-12)
        seen_empty_rows |= bool(lse1.isinf().any())
    assert seen_empty_rows


def test_block_backward_through_autograd_equals_the_analytic_one_fp64():
    """The chain rule flex's backward runs under cp (dL/do_b = w·dO, dL/dlse_b =
    w·(rowsum(dO ⊙ o_b) − D)), applied to the eager forward by autograd, equals the
    FlashAttention-2 backward of blocks.block_backward on every block (documents, GQA, empty
    rows). flex itself has no CPU backward: tests/gpu runs it."""
    from hpctrain.parallel.context.blocks import block_backward, block_forward
    from hpctrain.parallel.context.flex_block import autograd_block_backward

    through_autograd = autograd_block_backward(block_forward)
    for block, *tensors in ring_blocks():
        got = through_autograd(*tensors[:3], block, *tensors[3:])
        want = block_backward(*tensors[:3], block, *tensors[3:])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cp", [2, 4])
def test_empty_blocks_follow_from_chunk_indices_and_boundaries(cp):
    """ring.block_mask decides which (query chunk, key chunk) blocks are empty from the chunk
    indices and the rows' first/last document ids, never forming a mask: it agrees with the
    materialised causal same-document mask of the full rows on every block of every rank, over
    random packings (one long document, many short ones, documents crossing chunks), and the
    mask the eager math then reads is that mask's block."""
    from hpctrain.parallel.context.ring import block_mask
    from hpctrain.parallel.context.shard import chunk_ids

    C, gen = 5, torch.Generator().manual_seed(0)
    L = 2 * cp * C
    pos_L = torch.arange(L)
    causal_LL = pos_L[None, :] <= pos_L[:, None]
    for trial in range(40):
        starts = torch.rand(3, L, generator=gen) < (0.02, 0.1, 0.4)[trial % 3]
        ids_BL = torch.cumsum(starts.long(), dim=1)
        full_BLL = (ids_BL[:, :, None] == ids_BL[:, None, :]) & causal_LL
        docs = Documents.from_ids(ids_BL)
        for rank in range(cp):
            shard = shard_documents(docs, rank=rank, cp=cp)
            for kv_rank in range(cp):
                for x in (0, 1):
                    for y in (0, 1):
                        qc, kc = chunk_ids(rank, cp=cp)[x], chunk_ids(kv_rank, cp=cp)[y]
                        want = full_BLL[:, qc * C:(qc + 1) * C, kc * C:(kc + 1) * C]
                        block = block_mask(shard, kv_rank=kv_rank, x=x, y=y)
                        assert (block is None) == (not bool(want.any()))
                        if block is not None:
                            assert torch.equal(block.mask_BCC, want)


def test_document_ids_must_not_decrease():
    with pytest.raises(ValueError, match="row 1 decrease"):
        Documents.from_ids(torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]]))

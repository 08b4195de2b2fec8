"""The tensor-parallel table's per-parameter slices (no processes): for every parameter of the
model and every tp degree, the tp ranks' slices put back together are the full tensor, each
value counted once after dividing by its replicas; the styles are the Megatron layout."""

from __future__ import annotations

import pytest
import torch

from hpctrain.models import PRESETS, build_model
from hpctrain.models.llama import FAMILY as LLAMA
from hpctrain.parallel.tensor.plan import kv_slot, tp_slice


def _reassembled(full: torch.Tensor, name: str, *, tp: int, n_kv_heads: int) -> torch.Tensor:
    """The full tensor rebuilt from the distinct slices of tp ranks 0..tp-1."""
    pieces: dict[int, torch.Tensor] = {}
    dim = None
    for r in range(tp):
        s = tp_slice(name, family=LLAMA, tp=tp, tp_rank=r,
                     kv=kv_slot(n_kv_heads, tp=tp, tp_rank=r))
        dim = s.dim
        local = full if s.dim is None else full.chunk(s.parts, s.dim)[s.index]
        count = sum(tp_slice(name, family=LLAMA, tp=tp, tp_rank=q,
                             kv=kv_slot(n_kv_heads, tp=tp, tp_rank=q))
                    .index == s.index for q in range(tp))
        assert count == s.replicas, (name, r)  # replicas = ranks holding the same slice
        pieces[s.index] = local
    return full if dim is None else torch.cat([pieces[i] for i in sorted(pieces)], dim=dim)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slices_of_every_parameter_reassemble_the_full_model(tp):
    cfg = PRESETS["debug"]  # 2 kv heads: split at tp=2, replicated on 2 ranks at tp=4
    for name, p in build_model(cfg, seed=0).named_parameters():
        assert torch.equal(_reassembled(p.detach(), name, tp=tp, n_kv_heads=cfg.n_kv_heads),
                           p.detach()), name


def test_table_styles():
    def dim(name: str) -> int | None:
        return tp_slice(name, family=LLAMA, tp=2, tp_rank=1).dim

    assert dim("layers.3.attn.wq.weight") == 0 and dim("layers.3.mlp.w3.weight") == 0
    assert dim("layers.3.attn.wo.weight") == 1 and dim("layers.3.mlp.w2.weight") == 1
    assert dim("tok_embeddings.weight") == 0 and dim("output.weight") == 0
    assert dim("layers.3.attn_norm.weight") is None and dim("norm.weight") is None
    wo_bias = tp_slice("layers.0.attn.wo.bias", family=LLAMA, tp=2, tp_rank=1)
    assert wo_bias.dim is None  # added once
    wk = tp_slice("layers.0.attn.wk.weight", family=LLAMA, tp=4, tp_rank=3,
                  kv=kv_slot(2, tp=4, tp_rank=3))
    assert (wk.dim, wk.index, wk.parts, wk.replicas) == (0, 1, 2, 2)

"""Document boundaries of packed rows, and the attention backends that honour them."""

import pytest
import torch

from hpctrain.ops.attention import ATTENTION_BACKENDS
from hpctrain.ops.documents import Documents


def test_boundaries_from_end_tokens():
    tokens = torch.tensor([[5, 9, 1, 2, 9, 9, 3], [1, 1, 1, 1, 1, 1, 9]])
    docs = Documents.from_eod(tokens, eod=9)
    assert docs.ids_BL.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0] * 7]
    assert docs.positions_BL.tolist() == [[0, 1, 0, 1, 2, 0, 0], list(range(7))]
    assert docs.lengths() == [[2, 3, 1, 1], [7]]
    cu, longest = docs.cu_seqlens()
    assert cu.tolist() == [0, 2, 5, 6, 7, 14] and longest == 7


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_packed_row_equals_each_document_alone(backend):
    """Attention over a packed row gives, token by token, what each document gives alone."""
    torch.manual_seed(0)
    fn = ATTENTION_BACKENDS[backend]
    lengths = [3, 1, 5, 2]
    L = sum(lengths)
    q = torch.randn(1, 4, L, 8, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, L, 8, dtype=torch.float64)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packed = fn(q, k, v, Documents.from_ids(ids))
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = fn(q[:, :, part], k[:, :, part], v[:, :, part])
        torch.testing.assert_close(packed[:, :, part], alone, rtol=0, atol=1e-12)
        start += n

"""A per-batch memo for what attention backends derive from Documents.

Every layer of one forward receives the same Documents; a block mask (flex) or cu_seqlens
(flash, which needs a host sync) is worth building once per batch, not once per layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from hpctrain.ops.documents import Documents

T = TypeVar("T")


class LastDocuments(Generic[T]):
    """build(docs) for the last Documents seen, rebuilt when a new batch (another ids tensor,
    held weakly) or an in-place change (its version counter) arrives."""

    def __init__(self, build: Callable[[Documents], T]):
        self._build = build
        self._ids_ref: weakref.ref | None = None
        self._version = -1
        self._value: T | None = None

    def get(self, docs: Documents) -> T:
        ids_BL = docs.ids_BL
        if (self._ids_ref is None or self._ids_ref() is not ids_BL
                or self._version != ids_BL._version):
            self._value = self._build(docs)
            self._ids_ref, self._version = weakref.ref(ids_BL), ids_BL._version
        return self._value

"""A ledger of bytes held in tensors, de-duplicated by storage.

RSS is useless for tensors on CPU (allocator caching, the interpreter); summing storage bytes
of the tensors the trainer owns gives exact, device-independent numbers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def storage_key(storage: torch.UntypedStorage) -> int:
    """One storage's identity, shared by its views: the address of torch's StorageImpl (a
    data pointer is not one: every meta tensor's is 0, and the dry run's tensors are meta).
    Like an address it is reused once the storage is freed: compare only live storages."""
    return storage._cdata


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared storages count once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage_key(storage)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total

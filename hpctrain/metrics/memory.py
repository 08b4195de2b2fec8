"""A ledger of bytes held in tensors, de-duplicated by storage.

RSS is useless for tensors on CPU (allocator caching, the interpreter); summing storage bytes
of the tensors the trainer owns gives exact, device-independent numbers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (views and shared storages count once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def model_state_ledger(params: Iterable[torch.nn.Parameter], optimizer_state: list[torch.Tensor],
                       buffers: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """mem_params_bytes, mem_grads_bytes, mem_optim_bytes, mem_buffers_bytes for one rank."""
    params = list(params)
    seen: set[int] = set()
    return {
        "mem_params_bytes": storage_bytes(params, seen),
        "mem_grads_bytes": storage_bytes([p.grad for p in params], seen),
        "mem_optim_bytes": storage_bytes(optimizer_state, seen),
        "mem_buffers_bytes": storage_bytes(buffers, seen),
    }

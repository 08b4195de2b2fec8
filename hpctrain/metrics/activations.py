"""Measured activation memory: bytes autograd keeps for backward, live at the peak.

CPU has no allocator statistics for tensors (RSS and tracemalloc miss them), so the meter
counts what the planner's activation model predicts: every tensor saved for backward while
`ActivationMeter` is active (torch.autograd.graph.saved_tensors_hooks), de-duplicated by
storage (views of one buffer count once), and released when autograd drops it (after that
microbatch's backward). Parameters are model states, not activations, and are skipped.
Storages created by a rank's own communication buffers are not saved tensors and are not
counted. `peak_bytes` is the largest live total seen since `reset`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

from hpctrain.parallel.memory import storage_key


class _Saved:
    """Holds one saved tensor; its release (autograd freeing the graph) lowers the count."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: ActivationMeter, key: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Context manager counting live saved-for-backward bytes (module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        # Held, not only keyed: a storage freed later (ZeRO-3 re-points its parameters) could
        # hand its address, and so its key, to a new tensor that must be counted.
        self._held = [s for s in (p.untyped_storage() for p in params) if s.nbytes()]
        self.skip = {storage_key(s) for s in self._held}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak_bytes = 0
        pack, unpack = self._pack, self._unpack
        if "torch._dynamo" in sys.modules:  # train.compile built the model: the hooks run
            # between compiled graphs, and dynamo must not trace them (it would guard on each
            # storage address, recompile per tensor and rebuild _Saved without its fields);
            # without compile dynamo stays unimported (seconds per rank)
            pack, unpack = torch.compiler.disable(pack), torch.compiler.disable(unpack)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def reset(self) -> None:
        self.peak_bytes = self.live

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage_key(storage)
        if key in self.skip or storage.nbytes() == 0:
            return t
        if self.refs.get(key, 0) == 0:
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Saved(self, key, t)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

"""Measured activation memory: bytes autograd keeps for backward, live at the peak.

CPU has no allocator statistics for tensors (RSS and tracemalloc miss them), so the meter
counts what the planner's activation model predicts: every tensor saved for backward while
`ActivationMeter` is active (torch.autograd.graph.saved_tensors_hooks), de-duplicated by
storage (views of one buffer count once), and released when autograd drops it (after that
microbatch's backward). Parameters are model states, not activations, and are skipped: the
tensors given (the engine's `parameter_tensors`, ZeRO-3's gathered buffers among them).
Storages created by a rank's own communication buffers are not saved tensors and are not
counted. `peak_bytes` is the largest live total seen since `reset`.

A block under full activation checkpointing saves only its inputs in the forward; in backward
torch reruns it and keeps what it saves under torch's own hooks, where the meter's never see
it. While the meter is active, such a recomputation runs inside `_Recomputation`
(hpctrain.models.checkpointing.RECOMPUTE_CONTEXT), which counts the storages the rerun keeps
and raises the peak to the live total plus them at the rerun's end: the moment the block's
whole set is held again, before its backward consumes it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

from hpctrain.models.checkpointing import RECOMPUTE_CONTEXT
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
        # Held, not only keyed: a storage freed later could hand its address, and so its key,
        # to a new tensor that must be counted. Empty ones too: a ZeRO-3 unit's buffer is 0
        # bytes between its gathers (hpctrain.parallel.data.units) and saved views of it are
        # parameter memory, which the engine's ledger counts while gathered.
        self._held = [p.untyped_storage() for p in params]
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
        self._observing = RECOMPUTE_CONTEXT.set(lambda: _Recomputation(self))
        return self

    def __exit__(self, *exc) -> None:
        RECOMPUTE_CONTEXT.reset(self._observing)
        self._hooks.__exit__(*exc)


class _Recomputation:
    """One checkpointed block's rerun in backward (module docstring). Entered inside torch's
    recomputation hooks, it stacks hooks that count each new storage, then hand the tensor
    to torch's (which keep it for the block's backward)."""

    def __init__(self, meter: ActivationMeter):
        self.meter, self.bytes, self.seen = meter, 0, set()

    def __enter__(self) -> _Recomputation:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            raise RuntimeError("the recomputation context must run inside torch's checkpoint")
        keep, give = top

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            key = storage_key(storage)
            m = self.meter
            if key not in m.skip and key not in m.sizes and key not in self.seen:
                self.seen.add(key)
                self.bytes += storage.nbytes()
            return keep(t)  # torch's own: it may stop the rerun early (raises)

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, give)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        m = self.meter
        m.peak_bytes = max(m.peak_bytes, m.live + self.bytes)

"""Point-to-point helpers for the pipeline: tagged non-blocking send, blocking receive.

On gloo, `batch_isend_irecv` is reported unreliable, so each message is one `isend` with a tag
that identifies it uniquely, matched by one blocking `recv` with the same tag. Sends are kept
(`Outbox`) until `wait_all`, because a tensor must stay alive until its send completes.
Every wait takes the mesh's timeout explicitly: a peer that never answers raises after it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

MESSAGE_KINDS = ("F", "B")  # activations forward, gradients backward


def message_tag(kind: str, *, stage: int, microbatch: int, n_stages: int) -> int:
    """A unique non-negative tag for (kind, receiving stage, microbatch).

    tag = (microbatch · n_stages + stage) · 2 + kind_index, so no two messages of one step share
    a tag and a mismatched pair fails instead of delivering the wrong tensor.
    """
    if kind not in MESSAGE_KINDS:
        raise ValueError(f"message kind {kind!r} is not one of {MESSAGE_KINDS}")
    return (microbatch * n_stages + stage) * len(MESSAGE_KINDS) + MESSAGE_KINDS.index(kind)


class Outbox:
    """Outstanding isends of one step: keeps their tensors alive until `wait_all`."""

    def __init__(self, *, timeout: datetime.timedelta):
        self.timeout = timeout
        self._works: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, *, dst: int, tag: int) -> None:
        """Non-blocking send of a contiguous copy of `tensor` to global rank `dst`."""
        payload = tensor.detach().contiguous()
        self._works.append((dist.isend(payload, dst=dst, tag=tag), payload))

    def wait_all(self) -> None:
        for work, _ in self._works:
            work.wait(self.timeout)
        self._works.clear()


def recv(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device, src: int,
         tag: int, timeout: datetime.timedelta) -> torch.Tensor:
    """Blocking receive of a tensor of known shape/dtype from global rank `src`; raises when
    nothing arrives within `timeout`."""
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.irecv(out, src=src, tag=tag).wait(timeout)
    return out

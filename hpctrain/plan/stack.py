"""The training stack's communication: what it overlaps with compute, what stays exposed, and
the precision its gradients travel in.

Three overlap switches, one per kind of traffic, each describing software that exists:

  tp = "none"   every tensor-parallel all-reduce (or sp all-gather / reduce-scatter) blocks
                the GEMMs that need it (Megatron-LM 2021 and 2022, Shoeybi et al. 2019 f/g)
  tp = "full"   each collective is split into chunks pipelined with the GEMM that produces or
                consumes it (Transformer Engine userbuffers, Megatron-core --tp-comm-overlap,
                Wang et al. 2022 "Overlap communication with dependent computation"): a
                layer's forward exposes max(0, C_f − G_f), its backward max(0, C_b − G_b),
                C the layer's tp traffic in that pass and G its projection GEMMs (forward:
                QKV, out, up, down; backward: their input- and weight-gradient GEMMs)
  dp = True     gradients are reduce-scattered bucket by bucket while the last microbatch's
                backward runs, parameters all-gathered while the first forward runs
                (Megatron-core --overlap-grad-reduce --overlap-param-gather; PyTorch DDP
                buckets, Li et al. 2020): exposed = max(bucket, RS − W_b) + max(bucket,
                AG − W_f), W_b the backward (B + W) and W_f the forward of one microbatch
                on this rank (all its chunks), bucket = one bucket's collective (the last
                one cannot overlap anything)
  pp = True     stage-to-stage sends run on their own stream while the next action computes
                (Megatron-core's batched p2p with --overlap-p2p-communication): a hop
                costs its latency only

and the gradient reduction's element size:

  grad_reduce = "param"  gradients reduce in the training precision (2 bytes in bf16/fp16)
  grad_reduce = "fp32"   in fp32: Megatron-LM forces accumulate_allreduce_grads_in_fp32 for
                         bf16 (megatron/training/arguments.py: "bfloat16 requires gradient
                         accumulation and all-reduce to be done in fp32"); the parameter
                         all-gather of its distributed optimizer stays in bf16

`Stack()` is Megatron-LM 2021's stack (nothing overlapped except what `dp_overlap` says,
fp16 gradients); `MEGATRON_CORE` the README's H100 runs (all three overlaps, bf16 with fp32
gradient reduction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Megatron-core DDP bucket: max(40M, 1M·dp) parameters (distributed_data_parallel_config).
BUCKET_PARAMS = 40_000_000


@dataclass(frozen=True)
class Stack:
    """Which traffic the stack hides behind compute, and its gradients' element size
    (module docstring)."""

    tp: Literal["none", "full"] = "none"
    dp: bool = False
    pp: bool = False
    grad_reduce: Literal["param", "fp32"] = "param"

    def __post_init__(self) -> None:
        if self.tp not in ("none", "full"):
            raise ValueError(f"Stack.tp={self.tp!r} must be 'none' (blocking collectives) "
                             "or 'full' (chunked with the GEMMs, Transformer Engine)")
        if self.grad_reduce not in ("param", "fp32"):
            raise ValueError(f"Stack.grad_reduce={self.grad_reduce!r} must be 'param' or "
                             "'fp32'")

    def describe(self) -> str:
        parts = [name for name, on in (("tp", self.tp == "full"), ("dp", self.dp),
                                        ("pp", self.pp)) if on]
        text = "overlap " + "+".join(parts) if parts else "no overlap"
        return text + (", fp32 grad reduce" if self.grad_reduce == "fp32" else "")

    def grad_bytes(self, param_grad_bytes: int) -> int:
        """Bytes per gradient element in the dp reduce-scatter."""
        return 4 if self.grad_reduce == "fp32" else param_grad_bytes


NONE = Stack()
MEGATRON_CORE = Stack(tp="full", dp=True, pp=True, grad_reduce="fp32")


def exposed(comm_s: float, compute_s: float) -> float:
    """Seconds of `comm_s` left on the critical path when pipelined with `compute_s`."""
    return max(0.0, comm_s - compute_s)


def dp_exposed(rs_s: float, ag_s: float, *, bucket_s: float, backward_s: float,
               forward_s: float) -> float:
    """The dp = True exposure of a reduce-scatter `rs_s` and all-gather `ag_s` (module doc)."""
    return (max(min(bucket_s, rs_s), rs_s - backward_s)
            + max(min(bucket_s, ag_s), ag_s - forward_s))

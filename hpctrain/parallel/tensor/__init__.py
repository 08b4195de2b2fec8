"""Megatron-style tensor parallelism with sequence parallelism (see plan.py for the layout)."""

from hpctrain.parallel.tensor.comm import (
    CommCounter,
    copy_to_tp,
    gather_last,
    gather_seq,
    reduce_from_tp,
    reduce_scatter_seq,
    scatter_seq,
    split_last,
)
from hpctrain.parallel.tensor.grads import clip_tp_grads, sync_tp_grads, tp_grad_norm
from hpctrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelEntryRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from hpctrain.parallel.tensor.loss import vocab_parallel_cross_entropy
from hpctrain.parallel.tensor.plan import (
    TensorParallelPlan,
    apply_tensor_parallel,
    verify_tensor_parallel,
)
from hpctrain.parallel.tensor.volume import tp_activation_bytes

__all__ = [
    "ColumnParallelLinear", "CommCounter", "ParallelEntryRMSNorm", "RowParallelLinear",
    "TensorParallelPlan", "VocabParallelEmbedding", "apply_tensor_parallel", "clip_tp_grads",
    "copy_to_tp", "gather_last", "gather_seq", "reduce_from_tp", "reduce_scatter_seq",
    "scatter_seq", "split_last", "sync_tp_grads", "tp_activation_bytes", "tp_grad_norm",
    "verify_tensor_parallel", "vocab_parallel_cross_entropy",
]

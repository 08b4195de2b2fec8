"""Data parallelism: one flat shard layout for bucketed DDP and ZeRO stages 1-3."""

from __future__ import annotations

from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.data.zero import NormSpec


def build_data_parallel(model, cfg, mesh, *, norm: NormSpec, **axes) -> DataParallel:
    """The trainer's engine for `cfg.parallel` (zero, bucket_mb, grad_comm_dtype, offload) and
    train.zero3_reshard_after_forward, over the dp×cp group (the dp group at cp = 1:
    parameters are replicated over both), sharded inside one replica's part of it under HSDP
    (mesh.shard, mesh.replicate); `norm` (from the shard spec) and `axes` (pre_reduce,
    experts) compose it with tp, pp and ep."""
    p = cfg.parallel
    return DataParallel(model, group=mesh.shard, replicas=mesh.replicate,
                        batch_group=mesh.dp_cp, zero=p.zero, norm=norm,
                        precision=cfg.train.precision, optim=cfg.optim, bucket_mb=p.bucket_mb,
                        grad_comm_dtype=p.grad_comm_dtype, offload=p.offload,
                        reshard_after_forward=cfg.train.zero3_reshard_after_forward,
                        device=mesh.device, **axes)


__all__ = ["DataParallel", "NormSpec", "build_data_parallel"]

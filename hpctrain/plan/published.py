"""Published training runs the time model is checked against, and how each is predicted.

Each table is a `Source`: the cluster it ran on, its model family, the software stack its
paper or README describes (`hpctrain.plan.stack`) and the options it leaves unstated, which
`hpctrain.plan.assume.assume_unstated` searches (`Allowed`). The constants are the device
generation's (`hpctrain.plan.hardware`), never the table's:

  megatron_table1   Narayanan et al. 2021, Table 1 (A100): GPT, eager attention with fused
                    softmax, full recomputation, "the interleaved pipeline schedule with the
                    scatter/gather optimization" (§5.1), nothing overlapped; micro-batch size
                    not stated. Compared: executed TFLOP/s per GPU (recomputation included).
  korthikanti       Korthikanti et al. 2022, Tables 3 and 5 (A100): the same stack; full
                    recomputation without sp, or sp + selective recomputation; micro-batch size
                    stated, interleaving not. Compared: iteration time.
  megatron_h100     the Megatron-LM README's H100 weak-scaling table: Transformer Engine bf16
                    with flash attention, sp where tp > 1, the distributed optimizer (ZeRO-1),
                    tp/dp/pp overlap and fp32 gradient reduction (`stack.MEGATRON_CORE`);
                    micro-batch size, recomputation and interleaving not stated. Compared:
                    model TFLOP/s per GPU (Megatron's 72·B·s·l·h²·(1 + s/6h + V/12lh)).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hpctrain.plan.assume import Allowed, Assumed, assume_unstated
from hpctrain.plan.cluster import ClusterSpec, dgx_h100_cluster, megatron_a100_cluster
from hpctrain.plan.layout import Layout
from hpctrain.plan.shapes import GPTShape
from hpctrain.plan.stack import MEGATRON_CORE, NONE, Stack

INTERLEAVING = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclass(frozen=True)
class Source:
    """One published table: where it ran, what it ran, and what it left open."""

    cluster: Callable[[], ClusterSpec]
    vocab: int
    seq_len: int
    stack: Stack
    allowed: Allowed
    column: str  # the CSV column compared (tests/reference, shared/reference)
    metric: str = "tflops"  # tflops (executed), model_tflops (Megatron's model FLOPs), time
    attention: str = "eager"
    tied: bool = True
    zero: int = 0
    sp: bool = False  # sequence parallelism where tp > 1


@dataclass(frozen=True)
class Prediction:
    """A row predicted: the published value, ours, the error (ours/published − 1), and what
    the search assumed for the unstated settings."""

    published: float
    predicted: float
    assumed: Assumed

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


SOURCES: dict[str, Source] = {
    "megatron_table1": Source(megatron_a100_cluster, 51200, 2048, NONE,
                              Allowed((1, 2, 4, 8), ("full",), INTERLEAVING),
                              column="tflops_per_gpu"),
    "korthikanti_full": Source(megatron_a100_cluster, 51200, 2048, NONE,
                               Allowed((1,), ("full",), INTERLEAVING),
                               column="iter_time_full_recompute_s", metric="time"),
    "korthikanti_selective": Source(megatron_a100_cluster, 51200, 2048, NONE,
                                    Allowed((1,), ("selective",), INTERLEAVING),
                                    column="iter_time_sp_selective_s", metric="time", sp=True),
    "megatron_h100": Source(dgx_h100_cluster, 131072, 4096, MEGATRON_CORE,
                            Allowed((1, 2, 4), ("none", "selective", "full"), INTERLEAVING),
                            column="tflops_per_gpu", metric="model_tflops", attention="flash",
                            tied=False, zero=1, sp=True),
}


def predict_row(name: str, row: Mapping[str, str]) -> Prediction:
    """Predict one CSV row of source `name` (module docstring); ValueError for a name that is
    not in SOURCES."""
    if name not in SOURCES:
        raise ValueError(f"published source {name!r} is unknown; choose one of {list(SOURCES)}")
    src = SOURCES[name]
    model = GPTShape(f"gpt-{row.get('model') or row.get('model_size') or row.get('params_b')}",
                     n_layers=int(row["layers"]), dim=int(row["hidden"]),
                     n_heads=int(row["heads"]), vocab_size=src.vocab, max_seq_len=src.seq_len,
                     tied_embeddings=src.tied, attention=src.attention)
    tp, pp, gpus = int(row["tp"]), int(row["pp"]), int(row["gpus"])
    layout = Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, sp=src.sp and tp > 1, zero=src.zero)
    allowed = src.allowed
    if "micro_batch" in row:  # stated: the only option
        allowed = Allowed((int(row["micro_batch"]),), allowed.recomputes, allowed.virtual_stages)
    batch = int(row.get("batch") or row["global_batch"])
    cluster = src.cluster()
    found = assume_unstated(model, cluster, layout=layout, global_batch=batch,
                            seq_len=src.seq_len, allowed=allowed, ov=src.stack)
    t = found.candidate.time
    value = {"tflops": t.tflops_per_device, "time": t.step_time_s,
             "model_tflops": t.mfu * cluster.device.peak_flops("bf16") / 1e12}[src.metric]
    return Prediction(published=float(row[src.column]), predicted=value, assumed=found)

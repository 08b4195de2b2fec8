"""Checks of the model's shape: that it is a decoder hpctrain can build, and that the layout
can split it (tensor parallelism: `hpctrain.parallel.tensor.plan.unsplit` states what must
divide; pipeline stages: the schedule's chunks divide the layers)."""

from __future__ import annotations

from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.parallel.pipeline.schedules import chunks_per_rank
from hpctrain.parallel.tensor.plan import unsplit

SHAPE = ("model.", "parallel.tp", "parallel.pp", "parallel.virtual_stages", "parallel.sp",
          "parallel.schedule", "train.seq_len")

# The fix of each field tensor parallelism cannot split.
_TP_FIX = {
    "n_heads": "choose tp among the divisors of the head count",
    "ffn_dim": "choose an ffn_dim that is a multiple of tp",
    "vocab_size": "pad the vocabulary to a multiple of tp",
}


@check("model.dim", "model.n_heads", "model.head_dim")
def check_head_dim(c: Config) -> list[str]:
    m = c.model
    derived = m.head_dim == m.dim // m.n_heads
    if m.head_dim % 2 == 0 or (derived and m.dim % m.n_heads):
        return []
    if derived:
        return [f"model.dim={m.dim} / model.n_heads={m.n_heads} = {m.head_dim} is an odd head "
                "dimension; RoPE rotates pairs: choose dim and n_heads with an even quotient "
                "(or set an even model.head_dim)"]
    return [f"model.head_dim={m.head_dim} is odd; RoPE rotates pairs: choose an even one"]


@check(*SHAPE)
def check_model_shape(c: Config) -> list[str]:
    m, errs = c.model, []
    if m.dim % m.n_heads and m.head_dim == m.dim // m.n_heads:
        errs.append(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}: "
                    "choose a divisor, or set model.head_dim (then wq maps dim to "
                    "n_heads × head_dim)")
    if m.n_heads % m.n_kv_heads:
        errs.append(f"model.n_heads={m.n_heads} is not divisible by "
                    f"model.n_kv_heads={m.n_kv_heads}: choose kv heads that divide the heads")
    errs += _tp_problems(c) + _stage_problems(c)
    r = m.rope_scaling
    if r.type == "llama3" and r.high_freq_factor <= r.low_freq_factor:
        errs.append(f"model.rope_scaling.high_freq_factor={r.high_freq_factor:g} must exceed "
                    f"model.rope_scaling.low_freq_factor={r.low_freq_factor:g} (llama3 blends "
                    "the frequencies between them): e.g. 1.0 and 4.0, as Llama 3.1")
    if c.train.seq_len > m.max_seq_len:
        errs.append(f"train.seq_len={c.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}:"
                    f" lower train.seq_len or raise model.max_seq_len")
    return errs


def _tp_problems(c: Config) -> list[str]:
    m, tp, errs = c.model, c.parallel.tp, []
    for name in unsplit(m, tp):
        value = getattr(m, name)
        if name == "n_kv_heads":
            errs.append(f"model.n_kv_heads={value} and parallel.tp={tp}: kv heads must be "
                        "divisible by tp (split) or divide tp (replicated)")
        else:
            errs.append(f"model.{name}={value} is not divisible by parallel.tp={tp}: "
                        f"{_TP_FIX[name]}")
    if c.parallel.sp and c.train.seq_len % tp:
        errs.append(f"train.seq_len={c.train.seq_len} is not divisible by parallel.tp={tp}, "
                    "required by parallel.sp=true: choose a seq_len that is a multiple of tp "
                    "or set parallel.sp=false")
    return errs


def _stage_problems(c: Config) -> list[str]:
    p = c.parallel
    stages = p.pp * chunks_per_rank(p.schedule, p.virtual_stages)
    if c.model.n_layers % stages == 0:
        return []
    return [f"model.n_layers={c.model.n_layers} is not divisible by the {stages} pipeline "
            f"stages of parallel.pp={p.pp}, parallel.schedule={p.schedule}, "
            f"parallel.virtual_stages={p.virtual_stages}: choose pp and virtual_stages whose "
            f"product divides the layer count"]

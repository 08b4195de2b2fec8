"""No silent minutes: the line the logging rank writes before each phase that can take long
(model build, the first step), so a run that is working never looks hung."""

from __future__ import annotations

from hpctrain.config.schema import Config

BIG_MODEL_PARAMS = 500_000_000  # above this, building on a CPU takes a while


def build_note(cfg: Config, *, device_type: str) -> str:
    """Before the model is built: what is built, and how much memory its states take."""
    n = cfg.model.num_params()
    # fp32 weights + grads + two Adam moments: 16 bytes per parameter, before sharding
    states_gb = 16 * n / 1e9
    line = (f"building {cfg.model.name} ({n / 1e6:,.1f} M parameters, ~{states_gb:.3g} GB of "
            f"fp32 weights, gradients and Adam moments before sharding) on {device_type}")
    if device_type == "cpu" and n > BIG_MODEL_PARAMS:
        line += ": this can take minutes on a CPU"
    return line + eager_blocks_note(cfg, device_type=device_type)


def eager_blocks_note(cfg: Config, *, device_type: str) -> str:
    """Under cp on an accelerator, what the eager and sdpa blocks of ring attention cost: they
    form each block's scores (no fused kernel of theirs returns the lse a block needs)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp <= 1 or device_type == "cpu" or m.attention not in ("eager", "sdpa"):
        return ""
    C = t.seq_len // (2 * p.cp)
    scores_gb = t.micro_batch_size * (m.n_heads // p.tp) * C * C * 4 / 1e9
    return (f"; under parallel.cp={p.cp} model.attention={m.attention} runs each ring block's "
            f"eager math on {device_type}, forming its fp32 scores ({scores_gb:.3g} GB per "
            f"block at {C} tokens a chunk): model.attention=flash, flex or triton keep them on "
            "chip")


def first_step_note(cfg: Config, *, device_type: str, start: int) -> str:
    """Before the first step: which steps run, and why the first can be slow."""
    t = cfg.train
    why = []
    if t.compile != "none":
        why.append(f"train.compile={t.compile} compiles first (tens of seconds per graph on a "
                   "CPU)")
    if t.fp8 and device_type == "cpu":
        why.append("train.fp8 on a CPU runs float8 GEMMs in torch's CPU path, which can take "
                   "minutes per step on some CPUs (train.fp8=false or a GPU for speed)")
    if device_type == "cpu" and cfg.model.num_params() > BIG_MODEL_PARAMS:
        why.append(f"a {cfg.model.num_params() / 1e9:.2g} B-parameter model on a CPU is slow")
    line = f"training steps {start + 1}..{t.steps} of train.steps={t.steps}"
    return line + (f"; the first step can be slow: {'; '.join(why)}" if why else "")

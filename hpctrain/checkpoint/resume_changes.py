"""What a resume changes: the checkpoint's recorded settings against this run's.

Each checkpoint records the run's resolved `optim`, `train` and `data` groups in its
train_state.json (`recorded`). A resume compares them with this run's (`compare`):

- a changed key that leaves the continuation exact (the LR schedule and optimizer settings,
  train.steps, the batch sizes, checkpoint and logging cadence) is one log line each, `key:
  old → new`, and the run continues — unless the checkpoint ends a finished run (its step is
  train.steps): then nothing would train and the old results would pass for the new
  settings', so it is refused;
- a changed key that makes it inexact is refused before any tensor is read, unless
  train.resume_changes=allow: the tokens themselves (the tokenizer and its special tokens, the
  corpus, its format and split, how it is cut into samples) and the data order (train.seed, the
  sequence length, the batching and packing), since the sampler is a pure function of the data,
  the seed and the step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from hpctrain.config.schema import Config

log = logging.getLogger(__name__)

GROUPS = ("optim", "train", "data")
# Keys whose change makes the resumed run read other tokens, or the same in another order.
INEXACT = {
    "data.source", "data.paths", "data.val_paths", "data.format", "data.text_key",
    "data.tokenizer", "data.tokenizer_path", "data.bos_token", "data.eod_token",
    "data.bpe_vocab_size", "data.max_bytes", "data.val_fraction", "data.mixture", "data.stages",
    "data.packing",
    "data.on_bad_record", "train.seed", "train.seq_len", "train.batching",
}
# Keys that say how this invocation runs, not what it trains: never reported.
QUIET = {"data.name", "train.resume", "train.resume_changes", "train.stop_after", "train.profile",
         "train.profile_steps", "data.workers", "data.cache_dir", "data.shard_bytes"}


def recorded(cfg: Config) -> dict[str, Any]:
    """The settings a checkpoint records (train_state.json's `config`)."""
    return {g: dataclasses.asdict(getattr(cfg, g)) for g in GROUPS}


def _plain(value: Any) -> Any:
    """`value` as train_state.json gives it back: tuples (also nested, data.mixture's paths)
    are lists."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _flat(groups: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for group, values in groups.items():
        for key, value in (values or {}).items():
            out[f"{group}.{key}"] = _plain(value)
    return out


def compare(saved: dict[str, Any] | None, cfg: Config) -> tuple[list[str], list[str]]:
    """(one line per changed key, the changed keys that make the resume inexact); ([], [])
    for a checkpoint that recorded no settings (an older hpctrain)."""
    if not isinstance(saved, dict):
        return [], []
    before, now = _flat(saved), _flat(recorded(cfg))
    changed = [k for k in now if k in before and before[k] != now[k] and k not in QUIET]
    lines = [f"{k}: {before[k]!r} → {now[k]!r} since the checkpoint"
             + (" (the data read changes)" if k in INEXACT else "") for k in changed]
    return lines, [k for k in changed if k in INEXACT]


def refusal(path, inexact: list[str], saved: dict[str, Any], cfg: Config) -> str:
    """The message of a refused inexact resume: each key with both values, and the fixes."""
    before, now = _flat(saved), _flat(recorded(cfg))
    keys = "; ".join(f"{k}={before[k]!r} in the checkpoint, {now[k]!r} now" for k in inexact)
    return (f"resuming {path} would not continue the same run: {keys} (it would read other "
            "tokens or another order): set them back, or train.resume_changes=allow to "
            "continue anyway, or train.resume=never (or another run directory) to start over")


def finished_refusal(path, lines: list[str]) -> str:
    """A finished run met again with other settings: nothing would train, and its results
    would be reported under settings they were not made with (a second sweep into the same
    sweep directory over other values did so)."""
    return (f"{path} ends a finished run, and this run changes {'; '.join(lines)}: nothing "
            "would train, and that run's results would be reported as this run's. Use "
            "another run directory (hydra.run.dir, or hydra.sweep.dir for a sweep), raise "
            "train.steps to continue it, or train.resume=never to start over")


def acceptor(cfg: Config, *, logging_rank: bool):
    """`checkpoint.load`'s `accept`: refuse an inexact resume (ValueError, on every rank) unless
    train.resume_changes=allow; the logging rank logs each change."""
    def accept(verified, train_state: dict[str, Any]) -> None:
        saved = train_state.get("config")
        lines, inexact = compare(saved, cfg)
        if inexact and cfg.train.resume_changes != "allow":
            raise ValueError(refusal(verified.path, inexact, saved, cfg))
        if lines and train_state.get("step", 0) >= cfg.train.steps:
            raise ValueError(finished_refusal(verified.path, lines))
        for line in lines if logging_rank else ():
            log.info("%s", line)
    return accept

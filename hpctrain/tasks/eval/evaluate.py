"""task=eval: a checkpoint's loss and perplexity on a prepared dataset, and lm-eval's tasks.

One process, no ranks: the whole model on one device (`one_device.load_one_device`). The loss
is the in-training eval's (hpctrain.train.eval_set): samples 0 .. S−1 of the split in
micro-batches (dp = 1), each micro-batch's mean over its real tokens weighted by its token
count (`parallel.step.eval_loss`), under the run's autocast precision, so that

    eval_loss(task=eval on the checkpoint of step k) = eval_loss in metrics.jsonl at step k

up to fp32 rounding, for a run of any layout; perplexity = exp(loss). The data and the
sequence settings (data.*, train.seq_len, batching, precision, eval_samples,
micro_batch_size) are the run's saved ones (`.hydra/config.yaml`) unless eval.data=config;
the token cache is found (or built) as the run did (`data.prepare.prepare`).

The results go to `<run_dir>/eval.json` (the eval task's own run directory) and, with
logger.wandb on, to a W&B run there: eval_loss, eval_perplexity and lm_eval/<task>/<metric>
at the checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hpctrain.checkpoint.one_device import OneDevice, load_one_device, run_config
from hpctrain.config.build import build
from hpctrain.config.eval import EvalConfig, eval_settings
from hpctrain.config.schema import Config, DataConfig, TrainConfig
from hpctrain.data.dataset import open_split
from hpctrain.data.prepare import prepare, tokenizer_spec
from hpctrain.data.tokenizer import Encoder, TokenizerSpec, load
from hpctrain.distributed.device import resolve_device_type
from hpctrain.metrics.redact import Secrets
from hpctrain.metrics.wandb_logger import WandbLogger
from hpctrain.ops.documents import IGNORE_INDEX, split_micro_batch
from hpctrain.parallel.step import eval_loss
from hpctrain.train.eval_set import eval_indices

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalInputs:
    """What the loss is computed on, and where these settings came from ("run" or
    "config")."""

    data: DataConfig
    train: TrainConfig  # seq_len, batching, precision
    samples: int
    micro_batch: int
    origin: str


def eval_inputs(cfg: Config, s: EvalConfig, saved: dict[str, Any] | None, *,
                source: Path) -> EvalInputs:
    """The run's data and train settings (`saved`, module doc) or this command's."""
    use_run = s.data == "run" or (s.data == "auto" and saved is not None)
    if use_run and saved is None:
        raise ValueError(f"eval.data=run, but {source} belongs to no run directory with a "
                         "saved config (.hydra/config.yaml): set eval.data=config and give the "
                         "run's data.* and train.seq_len")
    if use_run:
        node = OmegaConf.create({k: saved.get(k) or {} for k in ("data", "train")})
        data = build(DataConfig, "data", OmegaConf.to_container(node.data, resolve=True))
        train = build(TrainConfig, "train", OmegaConf.to_container(node.train, resolve=True))
    else:
        data, train = cfg.data, cfg.train
    samples = train.eval_samples if s.samples is None else s.samples
    micro = train.micro_batch_size if s.micro_batch_size is None else s.micro_batch_size
    return EvalInputs(data, train, samples, micro, "run" if use_run else "config")


def dataset_loss(model: torch.nn.Module, inputs: EvalInputs, *, split: str, vocab: int,
                 device: torch.device) -> dict[str, Any]:
    """Loss (token-weighted mean, as in training), perplexity, samples and tokens of samples
    0 .. inputs.samples−1 of `split` (module doc)."""
    t = inputs.train
    data_dir = prepare(inputs.data)
    ds = open_split(data_dir, split, seq_len=t.seq_len, packing=inputs.data.packing,
                    batching=t.batching)
    if ds.vocab_size > vocab:
        raise ValueError(f"the data's tokenizer has {ds.vocab_size} token ids, the model only "
                         f"{vocab} (model.vocab_size): evaluate on data tokenised as the model "
                         "was trained (eval.data=run, or the model's data.tokenizer)")
    if inputs.samples > ds.n_samples:  # the indices wrap: the same samples again
        most = max(ds.n_samples // inputs.micro_batch, 1) * inputs.micro_batch
        raise ValueError(f"eval.samples={inputs.samples} is more than the {ds.n_samples} samples "
                         f"of the {split} split ({data_dir}): set eval.samples={most} (or fewer)")
    batches = [ds.rows(indices) for indices in eval_indices(
        ds.n_samples, samples=inputs.samples, dp=1, dp_rank=0, micro_batch=inputs.micro_batch)]
    tokens = sum(int((split_micro_batch(b)[1] != IGNORE_INDEX).sum()) for b in batches)
    loss = eval_loss(model, batches, precision=t.precision, dp_group=None)
    return {"data_dir": str(data_dir), "split": split, "seq_len": t.seq_len,
            "samples": inputs.samples, "tokens": tokens, "eval_loss": loss,
            "eval_perplexity": math.exp(loss) if loss < 700 else math.inf}


def model_tokenizer(loaded: OneDevice, inputs: EvalInputs) -> Encoder:
    """The tokenizer the model reads: a Hugging Face directory's own tokenizer.json, else the
    data's (the run's, or data.*'s: a trained bpe tokenizer lives in the token cache)."""
    if loaded.run_dir is None and (loaded.source / "tokenizer.json").is_file():
        return load(TokenizerSpec("hf", str(loaded.source)))
    data = inputs.data
    return load(tokenizer_spec(data, prepare(data) if data.tokenizer == "bpe" else None))


def run_eval(cfg: Config) -> dict[str, Any]:
    """task=eval (module doc); returns what eval.json holds."""
    s = eval_settings(cfg.extra, init_from=cfg.model.init_from)
    device = torch.device(resolve_device_type(s.device))
    loaded = load_one_device(from_=None if s.from_ in (None, "???") else s.from_,
                             init_from=None if s.from_ not in (None, "???")
                             else cfg.model.init_from, device=device.type)
    inputs = eval_inputs(cfg, s, run_config(loaded.run_dir), source=loaded.source)
    result: dict[str, Any] = {"checkpoint": str(loaded.source), "step": loaded.step,
                              "run_dir": None if loaded.run_dir is None else str(loaded.run_dir),
                              "settings_from": inputs.origin, "precision": inputs.train.precision,
                              "device": device.type}
    if inputs.samples:
        result.update(dataset_loss(loaded.model, inputs, split=s.split,
                                   vocab=loaded.shape.vocab_size, device=device))
    if s.lm_eval_tasks:
        from hpctrain.tasks.eval.lm_eval_adapter import lm_class, run_lm_eval

        lm = lm_class()(loaded.model, model_tokenizer(loaded, inputs),
                        max_length=loaded.shape.max_seq_len, precision=inputs.train.precision,
                        max_gen_toks=s.max_gen_toks)
        result["lm_eval"] = run_lm_eval(lm, s)
    out = Path(cfg.run_dir) / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    result["eval_json"] = str(out)
    _log_wandb(cfg, result)
    return result


def scalars(result: dict[str, Any]) -> dict[str, float]:
    """The numbers of a result, flat: eval_loss, eval_perplexity, eval_tokens and
    lm_eval/<task>/<metric> (lm-eval's 'acc,none' becomes 'acc')."""
    out = {k: float(result[k]) for k in ("eval_loss", "eval_perplexity") if k in result}
    if "tokens" in result:
        out["eval_tokens"] = float(result["tokens"])
    for task, metrics in (result.get("lm_eval") or {}).get("results", {}).items():
        for name, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"lm_eval/{task}/{name.removesuffix(',none')}"] = float(value)
    return out


def _log_wandb(cfg: Config, result: dict[str, Any]) -> None:
    if cfg.logger.wandb == "disabled":
        return
    logger = WandbLogger(cfg.logger, run_dir=Path(cfg.run_dir), config=dataclasses.asdict(cfg),
                         secrets=Secrets.of(cfg.cluster.env, cfg.logger.redact))
    values = scalars(result)
    logger.log(result["step"] or 0, values)
    logger.summary({**values, "checkpoint": result["checkpoint"]})
    logger.close()


def format_eval(result: dict[str, Any]) -> str:
    """The scores, one per line, and where eval.json went."""
    shown = {k: v for k, v in result.items() if k not in ("lm_eval", "eval_json")}
    return "\n".join([*(f"  {k:<22} {v:.6g}" if isinstance(v, float) else f"  {k:<22} {v}"
                         for k, v in shown.items() if v is not None),
                       f"outputs: {result['eval_json']}"])

"""task=generate: continue prompts with one whole model on one device, with a KV cache.

The model comes from a run directory or checkpoint (`generate.from`) or a Hugging Face
directory (`model.init_from`), loaded by hpctrain.checkpoint.one_device. Its tokenizer is the run's
data tokenizer (rebuilt from the run's saved config) or the directory's tokenizer.json. A
prompt is encoded without special tokens, after the tokenizer's bos when it has one (as
training frames a document); each step feeds only the new token through the model
(models.decode.KVCache) and picks the next one (train.sampling), until the tokenizer's
end-of-document id (not part of the completion) or generate.max_new_tokens. One record per
prompt goes to `<run_dir>/generations.jsonl`: prompt, completion (text), completion_ids, stop
("eod" or "length").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from hpctrain.checkpoint.hf_export import DTYPES
from hpctrain.checkpoint.one_device import OneDevice, load_one_device, run_config
from hpctrain.config.build import build
from hpctrain.config.generate import GenerateConfig, generate_settings, read_prompts
from hpctrain.config.schema import Config, DataConfig
from hpctrain.data.prepare import prepare, tokenizer_spec
from hpctrain.data.tokenizer import Encoder, TokenizerSpec, load
from hpctrain.distributed.device import resolve_device_type
from hpctrain.models.decode import KVCache
from hpctrain.tasks.generate.sampling import Sampling, next_token

log = logging.getLogger(__name__)
OUTPUT = "generations.jsonl"


@dataclass(frozen=True)
class Completion:
    ids: list[int]  # the new tokens, without the end-of-document id
    stop: Literal["eod", "length", "stop"]  # stop: the caller's stop condition held


@torch.inference_mode()
def generate_ids(model: torch.nn.Module, prompt_ids: Sequence[int], *, max_new_tokens: int,
                 sampling: Sampling, stop_id: int | None = None,
                 generator: torch.Generator | None = None,
                 stop: Callable[[list[int]], bool] | None = None) -> Completion:
    """Up to max_new_tokens tokens after `prompt_ids`: the prompt runs through the model once,
    then each chosen token alone, attending to the cached keys and values of those before.
    Ends early at `stop_id` (not kept) or once `stop(new tokens)` holds (a stop string)."""
    device = next(model.parameters()).device
    cache = KVCache(len(prompt_ids) + max_new_tokens)
    x_1L = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token_1 = next_token(model(x_1L, cache=cache)[:, -1], sampling, generator)
        if token_1.item() == stop_id:
            return Completion(out, "eod")
        out.append(int(token_1.item()))
        if stop is not None and stop(out):
            return Completion(out, "stop")
        x_1L = token_1.view(1, 1)
    return Completion(out, "length")


def model_tokenizer(loaded: OneDevice, *, init_from: str | None, data: DataConfig) -> Encoder:
    """The tokenizer the model was trained with: the run's data tokenizer, or the Hugging Face
    directory's tokenizer.json (data.bos_token / data.eod_token choose its special tokens)."""
    if init_from is not None:
        path = Path(init_from).expanduser() / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model.init_from={init_from} has no tokenizer.json: task=generate "
                             "needs the model's tokenizer; copy it into that directory")
        return load(TokenizerSpec("hf", str(path), data.bos_token, data.eod_token))
    saved = run_config(loaded.run_dir)
    if saved is None or not isinstance(saved.get("data"), dict):
        raise ValueError(f"{loaded.source} belongs to no run directory with a saved "
                         f"configuration ({loaded.run_dir}/.hydra/config.yaml), so its "
                         "tokenizer is unknown: give generate.from=<its run directory>")
    run_data = build(DataConfig, "data", saved["data"])
    work = prepare(run_data) if run_data.tokenizer == "bpe" else None  # bpe: trained there
    return load(tokenizer_spec(run_data, work))


def encode_prompts(enc: Encoder, prompts: list[str], *, s: GenerateConfig,
                   vocab_size: int, max_seq_len: int) -> list[list[int]]:
    """[bos] + ids of each prompt; ValueError when one does not fit the context with its new
    tokens or holds an id the model has not."""
    head = [] if enc.bos_id is None else [enc.bos_id]
    encoded = [head + enc.encode(p).tolist() for p in prompts]
    for i, ids in enumerate(encoded):
        if len(ids) + s.max_new_tokens > max_seq_len:
            raise ValueError(f"prompt {i + 1} is {len(ids)} tokens: with generate.max_new_tokens="
                             f"{s.max_new_tokens} it passes the model's context of "
                             f"{max_seq_len}; set generate.max_new_tokens="
                             f"{max(max_seq_len - len(ids), 0)} or shorten the prompt")
        if ids and max(ids) >= vocab_size:
            raise ValueError(f"prompt {i + 1} has token id {max(ids)}, but the model's vocabulary "
                             f"is {vocab_size}: the tokenizer is not the model's")
    return encoded


def run_generate(cfg: Config) -> dict[str, Any]:
    """task=generate (module docstring); returns where the generations went and the speed."""
    s = generate_settings(cfg.extra)
    prompts = read_prompts(s)
    device = resolve_device_type(s.device)
    loaded = load_one_device(from_=s.from_, init_from=cfg.model.init_from,
                             dtype=DTYPES[s.dtype], device=device, key="generate.from")
    enc = model_tokenizer(loaded, init_from=cfg.model.init_from, data=cfg.data)
    shape = loaded.shape
    encoded = encode_prompts(enc, prompts, s=s, vocab_size=shape.vocab_size,
                             max_seq_len=shape.max_seq_len)
    sampling = Sampling(s.temperature, s.top_k, s.top_p, vocab=min(enc.vocab_size,
                                                                   shape.vocab_size))
    generator = torch.Generator(device=device).manual_seed(s.seed)
    log.info("generating for %d prompt(s) with %s on %s", len(prompts), loaded.source, device)
    start, records = time.perf_counter(), []
    for prompt, ids in zip(prompts, encoded, strict=True):
        done = generate_ids(loaded.model, ids, max_new_tokens=s.max_new_tokens,
                            sampling=sampling, stop_id=enc.eod_id, generator=generator)
        records.append({"prompt": prompt, "completion": enc.decode(done.ids),
                        "completion_ids": done.ids, "stop": done.stop})
    seconds = time.perf_counter() - start
    path = Path(cfg.run_dir) / OUTPUT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")
    new_tokens = sum(len(r["completion_ids"]) for r in records)
    return {"generations": str(path), "prompts": len(records), "new_tokens": new_tokens,
            "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
            "source": str(loaded.source), "step": loaded.step, "device": device}


def format_generations(result: dict[str, Any]) -> str:
    """Each prompt and its completion (read back from generations.jsonl), then the speed."""
    path = Path(result["generations"])
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    rule = "─" * 78
    lines = []
    for r in records:
        lines += [rule, f"prompt: {r['prompt']}", f"completion ({len(r['completion_ids'])} "
                  f"tokens, stop: {r['stop']}): {r['completion']}"]
    speed = result.get("tokens_per_s")
    lines += [rule, f"{result['new_tokens']} new tokens"
              + (f" at {speed:.1f} tokens/s" if speed else "") + f"; outputs: {path}"]
    return "\n".join(lines)

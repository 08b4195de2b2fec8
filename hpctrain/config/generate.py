"""`generate.*` (task=generate): the settings, the prompts and their checks, apart from the
sampler so that validation and the schema read them without importing the model. (That a prompt
and its new tokens fit the model's context is checked again per prompt once it is tokenised:
hpctrain.tasks.generate.generate.)"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpctrain.config.build import build
from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.config.validate.keys import Range, at_least, positive, range_problems
from hpctrain.distributed.device import cuda_available

EXAMPLE = 'e.g. task=generate generate.from=outputs/run1 generate.prompt="Once upon a time"'


@dataclass(frozen=True)
class GenerateConfig:
    """Sample completions of prompts from one model on one device (task=generate).

    `from_` is the key `generate.from` (config.config_key)."""

    # a run directory (its newest verified checkpoint) or checkpoint; or set model=hf
    # model.init_from=<a Hugging Face directory> instead
    from_: str | None = None
    prompt: str | None = None  # one prompt; or generate.prompts_file
    prompts_file: str | None = None  # a text file, one prompt per line
    max_new_tokens: int = 64  # new tokens per prompt, fewer when the model ends the document
    temperature: float = 0.0  # 0: greedy (argmax); else softmax(logits / temperature)
    top_k: int = 0  # sample among the k likeliest tokens; 0: all
    top_p: float = 1.0  # nucleus: the likeliest tokens holding this much probability; 1: all
    seed: int = 0  # the sampler's generator (the same seed gives the same completions)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda if available, else cpu
    dtype: Literal["fp32", "bf16"] = "fp32"


def generate_settings(extra: dict[str, Any]) -> GenerateConfig:
    """The `generate` group as a GenerateConfig; ValueError naming an unknown or mistyped
    key."""
    return build(GenerateConfig, "generate", extra.get("generate") or {})


def source_problems(s: GenerateConfig, init_from: str | None) -> list[str]:
    """Exactly one model source: generate.from (which exists) or model.init_from."""
    if s.from_ is None and init_from is None:
        return [f"task=generate needs a model: generate.from=<run directory or checkpoint> or "
                f"model=hf model.init_from=<Hugging Face directory> ({EXAMPLE})"]
    if s.from_ is not None and init_from is not None:
        return [f"generate.from={s.from_} and model.init_from={init_from} both name the model "
                "to sample: keep one of them"]
    if s.from_ is not None and not Path(s.from_).expanduser().exists():
        return [f"generate.from={s.from_}: no such run directory or checkpoint"]
    return []


def read_prompts(s: GenerateConfig) -> list[str]:
    """The prompts: generate.prompt, or every line of generate.prompts_file; ValueError when
    neither or both are set, the file is missing, or a prompt is empty."""
    if (s.prompt is None) == (s.prompts_file is None):
        given = "both are set" if s.prompt is not None else "neither is set"
        raise ValueError(f"task=generate needs generate.prompt=<text> or generate.prompts_file="
                         f"<file, one prompt per line>, not both ({given}): {EXAMPLE}")
    if s.prompt is not None:
        if not s.prompt.strip():
            raise ValueError("generate.prompt is empty: give the text to continue, e.g. "
                             'generate.prompt="Once upon a time"')
        return [s.prompt]
    path = Path(s.prompts_file).expanduser()
    if not path.is_file():
        raise ValueError(f"generate.prompts_file={s.prompts_file}: no such file (a text file "
                         "with one prompt per line)")
    lines = path.read_text(encoding="utf-8").splitlines()
    empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if not lines or empty:
        where = f"line(s) {', '.join(map(str, empty[:5]))} are empty" if empty else "it is empty"
        raise ValueError(f"generate.prompts_file={s.prompts_file}: {where}; give one non-empty "
                         "prompt per line")
    return lines


GENERATE_RANGES: dict[str, Range] = {
    "generate.max_new_tokens": positive("e.g. generate.max_new_tokens=64"),
    "generate.temperature": at_least(0, "0 for greedy, e.g. generate.temperature=0.8 to "
                                        "sample"),
    "generate.top_k": at_least(0, "0 keeps every token, e.g. generate.top_k=50"),
    "generate.top_p": Range(lo=0, hi=1, lo_open=True, fix="1 keeps every token, e.g. "
                                                          "generate.top_p=0.9"),
}


@check("generate", "model.init_from", "model.max_seq_len")
def check_generate(c: Config) -> list[str]:
    """Every problem of the generate group (and model.init_from as its source)."""
    try:
        s = generate_settings(c.extra)
    except ValueError as err:  # unknown or mistyped keys: the rest would read defaults
        return [str(err)]
    values = {f"generate.{f.name}": getattr(s, f.name) for f in dataclasses.fields(s)}
    errs = [p.text for p in range_problems(values, GENERATE_RANGES)]
    errs += source_problems(s, c.model.init_from)
    try:
        read_prompts(s)
    except ValueError as err:
        errs.append(str(err))
    if s.device == "cuda" and not cuda_available():
        errs.append("generate.device=cuda but no CUDA device is visible: use "
                    "generate.device=auto (or cpu)")
    return errs + _context_problems(s, c)


def _context_problems(s: GenerateConfig, c: Config) -> list[str]:
    """With model.init_from the context is known now: the new tokens and at least one prompt
    token must fit in it."""
    if c.model.init_from is None or s.from_ is not None or s.max_new_tokens < 1:
        return []
    if s.max_new_tokens < c.model.max_seq_len:
        return []
    return [f"generate.max_new_tokens={s.max_new_tokens} leaves no room for a prompt in the "
            f"model's context of {c.model.max_seq_len} tokens (model.max_seq_len): set "
            f"generate.max_new_tokens={c.model.max_seq_len - 1} or fewer"]

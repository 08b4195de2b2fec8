"""What a run reads and writes, checked before any rank starts: every path, and whether the data
holds at least one batch and fits the model's vocabulary.

Each check is a rule of `hpctrain.config.validate` that reads the data (`data=True`: it runs
only for the tasks that read data), returning messages that name the key, the value and the
fix. The data size is known before tokenising for byte-level files and prepared token directories
(`check_data_size`, at parse time); for the rest `check_prepared` checks it right after
`prepare`, still in the launching process (hpctrain.dispatch.preflight, the sweep callback).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import math
import os
import re
from pathlib import Path

from hpctrain.config.build import format_problems
from hpctrain.config.rule import check
from hpctrain.config.schema import Config, corpus_name, corpus_view, tokenizer_kind
from hpctrain.data import prepare as prep
from hpctrain.data.records import SUFFIXES, content_kind, list_inputs
from hpctrain.data.tokenizer import EXTRA
from hpctrain.data.verify import check_token_dir
from hpctrain.models.llama.hf_config import model_tokenizer

TOKEN_FILES = ("meta.json", "train.bin", "val.bin")
META_KEYS = {"dtype", "train_tokens", "val_tokens", "vocab_size"}


NAME = re.compile(r"[A-Za-z0-9_.-]+")


@check("data.paths", "data.source", "data.format", "data.val_paths", "data.mixture",
       stage="input", data=True)
def check_data_paths(c: Config) -> list[str]:
    """data.paths of files/tokens: present, readable files (or directories of shards; for
    data.format=hf, directories saved by `datasets`)."""
    d = c.data
    for key in ("val_paths", "mixture"):
        if getattr(d, key) and d.source != "files":
            return [f"data.{key} reads files, but data.source={d.source}: set data=files (or "
                    f"data=jsonl) with data.paths, or remove data.{key}"]
    if d.stages and not d.mixture and d.source != "tokens":
        return ["data.stages weighs the corpora of data.mixture, but there is none: give "
                "data.mixture=[{name: web, paths: [...], weight: 0.7}, ...], or remove "
                "data.stages"]
    if d.source == "stdlib":
        return []
    if d.mixture:
        return _mixture_problems(c)
    if not d.paths:
        return [f"data.source={d.source} needs data.paths (files, globs or directories): e.g. "
                "data.paths=[/path/a.txt,'/path/docs/*.md']"]
    if d.source == "tokens":
        return _token_dir_problems(d.paths, stages=d.stages)
    errs = [e for key, patterns in (("data.paths", d.paths), ("data.val_paths", d.val_paths))
            for pattern in patterns for e in _pattern_problems(pattern, d.format, key=key)]
    return errs or _overlap_problems(d)


def _overlap_problems(d) -> list[str]:
    """A file both trained on and held out: the val loss would measure memorisation."""
    if not d.val_paths:
        return []
    train = {p.resolve() for p in list_inputs(d.paths, d.format)}
    both = sorted(p for p in list_inputs(d.val_paths, d.format) if p.resolve() in train)
    if not both:
        return []
    return [f"data.val_paths holds {both[0]}" + (f" and {len(both) - 1} more file(s)"
                                                  if len(both) > 1 else "")
            + ", which data.paths trains on too: the val loss would measure memorisation; "
            "remove it from one of them"]


def _mixture_problems(c: Config) -> list[str]:
    d = c.data
    if d.paths:
        return [f"data.paths={list(d.paths)} and data.mixture both name the corpus: give either "
                "(data.paths=[] with data.mixture)"]
    errs = _name_problems(d.mixture) + stage_problems(d.stages, [
        corpus_name(c, i) for i, c in enumerate(d.mixture)])
    for i, corpus in enumerate(d.mixture):
        key = f"data.mixture[{i}]"
        if not (corpus.weight > 0 and math.isfinite(corpus.weight)):
            errs.append(f"{key}.weight={corpus.weight:g} must be > 0: e.g. {key}.weight=1")
        if not corpus.paths:
            errs.append(f"{key}.paths is empty: give its files, globs or directories")
        errs += [e for p in corpus.paths for e in _pattern_problems(
            p, corpus.format or d.format, key=f"{key}.paths")]
    return errs + [e for p in d.val_paths
                   for e in _pattern_problems(p, d.format, key="data.val_paths")]


def _name_problems(mixture) -> list[str]:
    names = [corpus_name(c, i) for i, c in enumerate(mixture)]
    bad = [f"data.mixture[{i}].name={n!r} is not a metric name (letters, digits, _ . -): e.g. "
           f"data.mixture[{i}].name=web" for i, n in enumerate(names) if not NAME.fullmatch(n)]
    twice = sorted({n for n in names if names.count(n) > 1})
    return bad + ([f"data.mixture names {twice} more than one corpus: give each its own "
                   "name"] if twice else [])


def stage_problems(stages, names: list[str] | None) -> list[str]:
    """data.stages: steps increasing, weights ≥ 0 with a positive sum, corpora known (`names`;
    None: not known before the prepared data is read)."""
    errs, last = [], 0
    for k, stage in enumerate(stages):
        key = f"data.stages[{k}]"
        if stage.until_step <= last:
            after = f"data.stages[{k - 1}].until_step={last}" if k else "0"
            errs.append(f"{key}.until_step={stage.until_step} must be > {after}: stages run "
                        "in order, each until its step")
        last = max(last, stage.until_step)
        weights = list(stage.mixture.values())
        if not all(isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w)
                   and w >= 0 for w in weights) or not sum(weights) > 0:
            errs.append(f"{key}.mixture={dict(stage.mixture)} needs weights ≥ 0 with a "
                        f"positive sum: e.g. {key}.mixture={{{(names or ['web'])[0]}: 1}}")
        unknown = sorted(set(stage.mixture) - set(names)) if names is not None else []
        if unknown:
            errs.append(f"{key}.mixture names {unknown}, not corpora of data.mixture "
                        f"({names})")
    return errs


def _pattern_problems(pattern: str, fmt: str, *, key: str) -> list[str]:
    matches = glob.glob(os.path.expanduser(pattern))
    files = list_inputs((pattern,), fmt)
    if not matches:
        return [f"{key}: no file matches {pattern}: check the path (globs such as "
                "'dir/*.txt' are expanded)"]
    if fmt == "hf":
        bad = [m for m in matches if not (Path(m) / "dataset_info.json").is_file()]
        if bad:
            return [f"{key}: {bad[0]} is not a dataset saved by datasets' save_to_disk (no "
                    "dataset_info.json): give that directory (one split), or another "
                    "data.format"]
        return next(([e] for m in matches if (e := _hf_files_problem(Path(m), key=key))), [])
    if not files:
        want = f"{'/'.join(SUFFIXES[fmt])} files" if fmt in SUFFIXES else "files"
        return [f"{key}: {pattern} holds no {want} (data.format={fmt}): give files, "
                f"directories of them or a glob such as '{pattern.rstrip('/')}/*"
                f"{SUFFIXES.get(fmt, ('.txt',))[0]}'"]
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        return [f"{key}: {unreadable[0]} is not readable (permissions): fix them or drop "
                f"it from {key}"]
    return next(([e] for f in files if (e := _content_problem(f, fmt, key=key))), [])


def _hf_files_problem(directory: Path, *, key: str) -> str | None:
    """A saved dataset whose state.json lists data files it does not hold."""
    try:
        state = json.loads((directory / "state.json").read_text())
        files = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return (f"{key}: {directory}/state.json is missing or unreadable ({err}): save the "
                "dataset again with save_to_disk")
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        return (f"{key}: {directory} lacks {missing[0]}" + (f" and {len(missing) - 1} more"
                                                           if len(missing) > 1 else "")
                + ", which its state.json lists: copy the whole directory, or save the "
                "dataset again with save_to_disk")
    return None


def _content_problem(path: Path, fmt: str, *, key: str) -> str | None:
    """A file whose content data.format would misread (identified by its first bytes)."""
    kind = content_kind(path)
    if fmt == "text" and kind is not None:
        want = "parquet" if kind == "parquet" else "jsonl"
        return (f"{key}: {path} is a {kind} file (its first bytes), which data.format=text "
                f"would tokenise as one document of raw bytes: set data.format={want}"
                + ("" if kind == "parquet" else " if it holds JSON Lines, else decompress it"))
    if fmt == "jsonl" and kind == "parquet":
        return (f"{key}: {path} is a Parquet file (its first bytes), not JSON Lines: set "
                "data.format=parquet")
    if fmt == "parquet" and kind != "parquet":
        return (f"{key}: {path} is not a Parquet file (it does not begin with PAR1): set "
                f"data.format={'jsonl' if kind else 'jsonl or text'} to match what it holds")
    return None


@check("data.format", "data.paths", stage="input", data=True)
def check_format(c: Config) -> list[str]:
    """The optional packages data.format needs are installed."""
    d = c.data
    if d.source != "files":
        return []
    views = [(f"data.mixture[{i}].format" if m.format else "data.format", corpus_view(d, m))
             for i, m in enumerate(d.mixture)]
    views += [("data.format", d)] if not d.mixture or d.val_paths else []
    return list(dict.fromkeys(e for key, view in views for e in _format_problems(key, view)))


def _format_problems(key: str, d) -> list[str]:
    need = {"parquet": ["pyarrow"], "hf": ["datasets"]}.get(d.format, [])
    if d.format == "jsonl" and any(content_kind(p) == "zstd"
                                   for p in prep.source_files(d) + prep.val_files(d)):
        need.append("zstandard")
    missing = [m for m in need if not _installed(m)]
    extra = "pip install 'hpctrain[hf]'" if d.format == "hf" else EXTRA
    return [f"{key}={d.format} needs {', '.join(missing)}: {extra}"] if missing else []


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


@check("data.tokenizer", "data.tokenizer_path", "data.bos_token", "data.eod_token",
       stage="input", data=True)
def check_tokenizer(c: Config) -> list[str]:
    """data.tokenizer loads (its file, its package, data.bos_token and data.eod_token)."""
    d = c.data
    if d.source == "tokens":
        return []
    if d.tokenizer in ("byte", "bpe") and d.tokenizer_path:
        kind = tokenizer_kind(d.tokenizer_path)
        return [f"data.tokenizer={d.tokenizer} reads no tokenizer file, but data.tokenizer_path="
                f"{d.tokenizer_path} is given: set data.tokenizer={kind} to tokenise with it, "
                "or drop data.tokenizer_path"]
    if d.tokenizer == "bpe":
        missing = not _installed("tokenizers")
        return [f"data.tokenizer=bpe needs the tokenizers package: {EXTRA}"] if missing else []
    try:
        prep.tokenizer_vocab(d)
    except ValueError as err:
        return [str(err)]
    return []


def _token_dir_problems(paths: tuple[str, ...], *, stages=()) -> list[str]:
    if len(paths) != 1:
        return [f"data.source=tokens reads one prepared directory but data.paths has "
                f"{len(paths)}: give one (data.paths=[<dir with {', '.join(TOKEN_FILES)}>])"]
    root = Path(paths[0]).expanduser()
    missing = [name for name in TOKEN_FILES if not (root / name).is_file()]
    try:
        meta = {} if missing else json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if missing or not isinstance(meta, dict) or not META_KEYS <= meta.keys():
        what = f"lacks {', '.join(missing)}" if missing else "has an unreadable meta.json"
        return [f"data.paths={paths[0]} (data.source=tokens) {what}: give a directory written "
                "by hpctrain's prepare (data.source=files writes one under data.cache_dir)"]
    names = [row.get("name") for row in meta.get("mixture") or []]
    if stages and not names:
        return [f"data.stages weighs a mixture's corpora, but {paths[0]} holds one corpus: "
                "remove data.stages"]
    return stage_problems(stages, names)


@check("data.cache_dir", "data.", stage="input", data=True)
def check_cache_dir(c: Config) -> list[str]:
    """data.cache_dir must be writable, unless the data is prepared there already."""
    d = c.data
    if d.source == "tokens":
        return []
    root = Path(d.cache_dir).expanduser()
    existing = next(p for p in (root, *root.parents) if p.exists())
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return []
    if existing.is_dir() and prep.cached_dir(d) is not None:
        return []
    what = "is a file" if not existing.is_dir() else "is not writable"
    return [f"data.cache_dir={d.cache_dir}: {existing} {what}, so the tokens cannot be "
            "prepared: set data.cache_dir (or $HPCTRAIN_CACHE) to a writable directory"]


def tokens_of(c: Config, data_dir: Path | None = None) -> tuple[int, int] | None:
    """(train, val) tokens: from a prepared directory's meta.json, else predicted; None when
    only preparing can tell (BPE, stdlib)."""
    if data_dir is None and c.data.source == "tokens":
        data_dir = Path(c.data.paths[0]).expanduser()
    if data_dir is None:
        return prep.predicted_split(c.data)
    meta = json.loads((data_dir / "meta.json").read_text())
    return meta["train_tokens"], meta["val_tokens"]


def data_size_problems(c: Config, *, train: int, val: int) -> list[str]:
    """A split shorter than one batch (train) or one eval batch (val) is refused."""
    t, dp, errs = c.train, c.parallel.dp, []
    need = t.global_batch_size * t.seq_len + 1
    if train < need:
        more = (f"data.max_bytes={c.data.max_bytes}" if c.data.source == "stdlib" else
                "data.paths")
        errs.append(f"the data's train split holds {train} tokens, fewer than one batch needs: "
                    f"train.global_batch_size={t.global_batch_size} × train.seq_len={t.seq_len}"
                    f" + 1 = {need}: add data ({more}) "
                    "or lower train.global_batch_size or train.seq_len")
    rows = t.micro_batch_size * dp if t.eval_every else 1
    need = rows * t.seq_len + 1
    if val < need:
        batch = (f"one eval batch needs: train.micro_batch_size={t.micro_batch_size} × "
                 f"parallel.dp={dp} × " if t.eval_every else "one sample needs: ")
        source = ("data.val_paths" if c.data.val_paths else
                  f"data.val_fraction={c.data.val_fraction}")
        errs.append(f"the data's val split holds {val} tokens ({source}), fewer than "
                    f"{batch}train.seq_len={t.seq_len} + 1 "
                    f"= {need}: " + ("add data to data.val_paths" if c.data.val_paths else
                                     "raise data.val_fraction or add data")
                    + (", or set train.eval_every=0" if t.eval_every else ""))
    return errs


@check("data.", "train.", "parallel.dp", data=True)
def check_data_size(c: Config) -> list[str]:
    counts = tokens_of(c)
    return [] if counts is None else data_size_problems(c, train=counts[0], val=counts[1])


def corpus_size_problems(c: Config, corpora: list[dict]) -> list[str]:
    """Each corpus of a prepared mixture holds one sample in each of its split ranges: a window
    of train.seq_len + 1 tokens (batching=rows), one (input, target) pair (batching=tokens)."""
    need = c.train.seq_len + 1 if c.train.batching == "rows" else 2
    errs = []
    for row in corpora:
        for split, fix in (("train", "give it more data or lower data.val_fraction"),
                           ("val", "raise data.val_fraction or give data.val_paths")):
            lo, hi = row.get(split, (0, need))
            if hi - lo < need:
                errs.append(f"corpus {row.get('name')!r} holds {hi - lo} tokens in the {split} "
                            f"split, fewer than one sample needs (train.seq_len="
                            f"{c.train.seq_len} + 1 = {c.train.seq_len + 1} with "
                            f"train.batching=rows, 2 with tokens): {fix}, or lower "
                            "train.seq_len")
    return errs


def check_prepared(c: Config, data_dir: Path) -> None:
    """After `prepare`: ValueError (the usual one message) if the prepared directory is
    damaged, holds ids outside the vocabulary (hpctrain.data.verify) or a split is shorter
    than a batch."""
    errs = check_token_dir(data_dir, vocab_size=c.model.vocab_size, rebuild=_rebuild(c, data_dir))
    if not errs:
        train, val = tokens_of(c, data_dir)
        errs = data_size_problems(c, train=train, val=val) + corpus_size_problems(
            c, json.loads((data_dir / "meta.json").read_text()).get("mixture") or [])
    if errs:
        raise ValueError(format_problems(errs) + f"\n(prepared data: {data_dir})")


def _rebuild(c: Config, data_dir: Path) -> str:
    if c.data.source == "tokens":
        return ("prepare it again from its corpus (python -m hpctrain task=prepare with that "
                "corpus's data.* keys) and point data.paths at the new directory")
    return (f"delete {data_dir} and run again: it is rebuilt from data.paths (python -m "
            "hpctrain task=prepare with the same data.* keys rebuilds it alone)")


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@check("data.tokenizer", "data.", "model.init_from", data=True)
def check_model_tokenizer(c: Config) -> list[str]:
    """With model.init_from holding a tokenizer.json, the data must be tokenised by it: the
    pretrained embedding rows are that tokenizer's ids. Compared by file hash (prepared data
    records its tokenizer's in meta.json)."""
    d, own = c.data, model_tokenizer(c.model.init_from)
    if own is None:
        return []
    fix = (f"the model's own tokenizer is the default: drop data.tokenizer and "
           f"data.tokenizer_path (or set data.tokenizer_path={c.model.init_from})")
    if d.source == "tokens":
        meta_path = Path(d.paths[0]).expanduser() / "meta.json"
        meta = json.loads(meta_path.read_text())
        if meta.get("tokenizer_sha256") == _file_sha256(own):
            return []
        return [f"data.paths={d.paths[0]} was prepared with data.tokenizer="
                f"{meta.get('tokenizer')} (sha256 {str(meta.get('tokenizer_sha256'))[:12]}), "
                f"not model.init_from={c.model.init_from}'s tokenizer.json (sha256 "
                f"{_file_sha256(own)[:12]}): prepare the corpus with it (task=prepare "
                f"data.tokenizer=hf data.tokenizer_path={c.model.init_from})"]
    used = Path(d.tokenizer_path or "").expanduser()
    used = used / "tokenizer.json" if used.is_dir() else used
    if d.tokenizer == "hf" and used.is_file() and _file_sha256(used) == _file_sha256(own):
        return []
    given = f"data.tokenizer={d.tokenizer}" + (f" data.tokenizer_path={d.tokenizer_path}"
                                               if d.tokenizer_path else "")
    return [f"{given} is not the tokenizer of model.init_from={c.model.init_from} (its "
            f"tokenizer.json), whose ids the pretrained embedding holds: {fix}"]


@check("model.vocab_size", "data.", data=True)
def check_vocab(c: Config) -> list[str]:
    """model.vocab_size must hold every token id the tokenizer produces."""
    d, have = c.data, c.model.vocab_size
    if d.source == "tokens":
        meta = Path(d.paths[0]).expanduser() / "meta.json"
        need, what = json.loads(meta.read_text())["vocab_size"], f"prepared data ({meta})"
    else:
        need, what = prep.tokenizer_vocab(d), f"data.tokenizer={d.tokenizer}"
        what += f" ({d.tokenizer_path})" if d.tokenizer in ("hf", "tiktoken") else ""
    if have >= need:
        return []
    fix = 1 << (need - 1).bit_length()  # a power of two: every tp up to it divides it
    least = f" (or at least {need})" if fix != need else ""
    return [f"model.vocab_size={have} is smaller than the {need} token ids of {what}: "
            f"set model.vocab_size={fix}{least}"]

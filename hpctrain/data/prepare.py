"""Tokenise a corpus into the memmap token layout: `train.bin`/`val.bin` + `meta.json`.

Layout: a flat little-endian uint16 (vocab ≤ 65536) or uint32 array of token ids, each document
framed as [bos] ids [eod]. `meta.json` records dtype, counts, the tokenizer (kind, sha256, bos
and eod) and sources; `train.idx`/`val.idx` are the document index (int64 offsets of the eod
tokens, hpctrain.data.packing) that dynamic batching reads; `manifest.json` holds every file's
size, sha256, token count and largest id (hpctrain.data.assemble).

Streaming and parallel: the inputs (data.format, hpctrain.data.records) are cut into units of
about data.shard_bytes of input (runs of files; a plain JSON Lines file larger than that is cut
into byte ranges), each tokenised into its own shard by one of data.workers processes
(hpctrain.data.shards), then the shards are concatenated in order. A shard depends only
on its unit, so the output is byte-identical whatever the number of workers. Finished shards
survive an interruption (in `<key>.partial/`): running again resumes.

A prepared directory is keyed by a hash of its inputs (files, sizes, mtimes, settings and the
tokenizer's hash), built under `<key>.partial` while holding `<key>.lock` and renamed into
place, so concurrent or interrupted runs never see a half-written dataset.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sysconfig
import time
from contextlib import contextmanager
from pathlib import Path

from hpctrain.config.schema import DataConfig, corpus_name, corpus_view
from hpctrain.data.assemble import Stream, assemble
from hpctrain.data.bpe_train import BPE_EOD, train_bpe
from hpctrain.data.mixture import mixture_plan, single_plan
from hpctrain.data.prepare_share import await_progress, task0_alive
from hpctrain.data.records import list_inputs, splittable
from hpctrain.data.shards import Input, ShardStats, Unit, finished, input_bytes, write_shard
from hpctrain.data.tokenizer import BYTE_EOD, TokenizerSpec, load

log = logging.getLogger(__name__)
__all__ = ["BYTE_EOD", "prepare", "source_files", "tokenizer_vocab", "split_sizes"]
PROGRESS_S = 10.0  # at most one progress line this often


def source_files(data: DataConfig) -> list[Path]:
    """The inputs to tokenise, in a deterministic order (stdlib: this Python's sources, the
    first ones that hold data.max_bytes)."""
    if data.source == "stdlib":
        files, total = [], 0
        for f in _python_sources(Path(sysconfig.get_paths()["stdlib"])):
            if total >= data.max_bytes:
                break
            files.append(f)
            total += f.stat().st_size
        return files
    if data.mixture:
        return [f for c in data.mixture for f in list_inputs(c.paths, corpus_view(data, c).format)]
    return list_inputs(data.paths, data.format)


def _python_sources(root: Path):
    """The `*.py` files under `root` in sorted path order, read lazily (a depth-first walk with
    each directory's entries sorted by name gives that order), without entering
    site-packages or following directory links."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            if e.name != "site-packages":
                yield from _python_sources(Path(e.path))
        elif e.name.endswith(".py") and e.is_file():
            yield Path(e.path)


def val_files(data: DataConfig) -> list[Path]:
    """The inputs of the val split when data.val_paths names them, else []."""
    return list_inputs(data.val_paths, data.format) if data.val_paths else []


def input_format(data: DataConfig) -> str:
    return "text" if data.source == "stdlib" else data.format


def _limits(data: DataConfig, files: list[Path]) -> list[Input]:
    """The inputs (path, 0, end byte): data.max_bytes caps the stdlib default only (whole
    files after it are dropped); files are read whole."""
    if data.source != "stdlib":
        return [(str(f), 0, None) for f in files]
    out, total = [], 0
    for f in files:
        if total >= data.max_bytes:
            break
        take = min(f.stat().st_size, data.max_bytes - total)
        out.append((str(f), 0, take))
        total += take
    return out


def tokenizer_spec(data: DataConfig, work: Path | None = None) -> TokenizerSpec:
    """The tokenizer to load; bpe: the one prepare trains into `work`."""
    if data.tokenizer == "bpe":
        path = None if work is None else str(work / "tokenizer.json")
        return TokenizerSpec("hf", path, bos_token="", eod_token=BPE_EOD)
    return TokenizerSpec(data.tokenizer, data.tokenizer_path, data.bos_token, data.eod_token)


def tokenizer_vocab(data: DataConfig) -> int:
    """Token ids the tokenizer of `data` produces (a model needs at least this vocab_size);
    ValueError (with the fix) when the tokenizer cannot be loaded."""
    if data.tokenizer == "bpe":
        return data.bpe_vocab_size
    return load(tokenizer_spec(data)).vocab_size


def split_sizes(n_tokens: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) token counts of a prepared dataset of n_tokens; val holds at least one."""
    n_val = min(n_tokens, max(1, int(n_tokens * val_fraction)))
    return n_tokens - n_val, n_val


def predicted_split(data: DataConfig) -> tuple[int, int] | None:
    """The (train, val) token counts `prepare` will produce, computed from file sizes without
    reading them (byte-level text files: a file is its bytes + eod, an empty one is skipped);
    None where that needs more (other formats and tokenizers, or the whole stdlib)."""
    if (data.source != "files" or data.tokenizer != "byte" or data.format != "text"
            or data.mixture):
        return None

    def tokens(files: list[Path]) -> int:
        sizes = [f.stat().st_size for f in files]
        return sum(sizes) + sum(1 for s in sizes if s)

    if data.val_paths:
        return tokens(source_files(data)), tokens(val_files(data))
    return split_sizes(tokens(source_files(data)), data.val_fraction)


def _cache_key(data: DataConfig, files: list[Path]) -> str:
    h = hashlib.sha256()
    spec = tokenizer_spec(data)
    parts = [data.source, input_format(data), data.text_key, data.on_bad_record,
             data.tokenizer, data.bos_token, data.eod_token, data.val_fraction, data.shard_bytes]
    parts += [data.bpe_vocab_size] if data.tokenizer == "bpe" else []
    parts += [data.max_bytes] if data.source == "stdlib" else []
    # the corpora's paths and names: their weights and data.stages pick samples at run time
    parts += [[(corpus_name(c, i), c.paths, c.format, c.text_key)
               for i, c in enumerate(data.mixture)]] if data.mixture else []
    parts += [load(spec).sha256] if spec.path else []
    for part in parts:
        h.update(repr(part).encode())
    for f in [*files, None, *val_files(data)]:  # None: where the val split's files start
        if f is None:
            h.update(b"val_paths")
            continue
        # an hf dataset is a directory: each of its files counts
        for g in sorted(f.rglob("*")) if f.is_dir() else [f]:
            st = g.stat()
            h.update(f"{g}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def cached_dir(data: DataConfig) -> Path | None:
    """The prepared directory of `data` if it is already in the cache, else None."""
    files = source_files(data) if data.source != "tokens" else []
    if not files:
        return None
    out = _out_dir(data, files)
    return out if (out / "meta.json").exists() else None


def _out_dir(data: DataConfig, files: list[Path]) -> Path:
    return Path(os.path.expanduser(data.cache_dir)) / "data" / _cache_key(data, files)


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a second prepare of the same data waits, then reuses
        yield


def prepare(data: DataConfig, *, share: tuple[int, int] = (0, 1),
            timeout_s: float = 600.0) -> Path:
    """Return the prepared token directory for `data`, building it if needed (module doc).

    `share` = (task, tasks): one of `tasks` processes (the tasks of a Slurm job) that build it
    together: task t tokenises units t, t + tasks, ...; task 0 also trains a bpe tokenizer
    first, waits for every unit and assembles; the others wait for the result. A wait that
    sees no progress for `timeout_s` (a task died) stops with the fix: run it again, the
    finished shards are kept."""
    if data.source == "tokens":
        return Path(os.path.expanduser(data.paths[0]))
    files = source_files(data)
    if not files:
        raise ValueError(f"data.source={data.source}: no input files found "
                         f"(data.paths={list(data.paths)}, data.format={data.format})")
    out = _out_dir(data, files)
    if (out / "meta.json").exists():  # every rank looks; no lock (nor a writable cache) needed
        return out
    if share[0] > 0:  # a helper task: its units, then the assembled result of task 0
        _build(data, files, out, share=share, timeout_s=timeout_s)
        await_progress(lambda: (out / "meta.json").exists(), timeout_s,
               what=f"task 0 assembling {out}", progress=task0_alive(out))
        return out
    with _locked(out.with_name(f"{out.name}.lock")):
        if not (out / "meta.json").exists():
            _build(data, files, out, share=share, timeout_s=timeout_s)
    return out


def _build(data: DataConfig, files: list[Path], out: Path, *, share: tuple[int, int],
           timeout_s: float) -> None:
    work = out.with_name(f"{out.name}.partial")
    (work / "shards").mkdir(parents=True, exist_ok=True)
    inputs = _limits(data, files)
    task, tasks = share
    if data.tokenizer == "bpe" and task > 0:  # task 0 trains it
        await_progress(lambda: (work / "tokenizer.json").exists(), timeout_s,
               what=f"task 0 training the bpe tokenizer in {work}", progress=task0_alive(out))
    elif data.tokenizer == "bpe" and not (work / "tokenizer.json").exists():
        n = len(data.mixture) or 1  # the train groups: never the val files
        train_bpe(data, [(group, input_format(view), view.text_key) for group, view in
                         zip(_input_groups(data, inputs)[:n], _group_views(data)[:n],
                             strict=True)], work)
    spec = tokenizer_spec(data, work)
    encoder = load(spec)
    dtype = "uint16" if encoder.vocab_size <= 65536 else "uint32"
    groups = _input_groups(data, inputs)  # one per corpus, then the val files (if any)
    units: list[list[Unit]] = []
    for group, view in zip(groups, _group_views(data), strict=True):
        units.append(_units(view, group, work / "shards", spec, dtype,
                            first=sum(map(len, units))))
    start, every = time.monotonic(), [u for g in units for u in g]
    if tasks > 1:
        log.info("prepare: task %d of %d tokenises %d of the %d units", task, tasks,
                 len(every[task::tasks]), len(every))
    _run_units(every[task::tasks], workers=data.workers)
    if task > 0:
        return
    await_progress(lambda: all(finished(u) is not None for u in every), timeout_s,
           what=f"the shards of tasks 1..{tasks - 1}",
           progress=lambda: sum(finished(u) is not None for u in every))
    stats = ShardStats()
    for u in every:
        stats.add(finished(u))
    streams = [Stream(tuple(u.stem for u in g), tuple(finished(u).tokens for u in g))
               for g in units]
    plan, report = _plan(data, streams)
    files_entry = assemble(plan, work, dtype=dtype)
    (work / "manifest.json").write_text(json.dumps({
        "files": files_entry, "shards": sum(map(len, units)),
        "inputs": [{"path": p, "bytes": os.path.getsize(p)}
                   for p in dict.fromkeys(p for g in groups for p, _, _ in g)]},
        indent=2))
    meta = _meta(data, encoder, stats, files_entry, dtype=dtype)
    (work / "meta.json").write_text(json.dumps({**meta, **report}, indent=2))
    shutil.rmtree(work / "shards")  # concatenated into train/val: not kept twice
    work.rename(out)
    _summary(stats, out, seconds=time.monotonic() - start)


def _input_groups(data: DataConfig, inputs: list[Input]) -> list[list[Input]]:
    """The inputs as streams: each corpus of data.mixture (or all inputs), then data.val_paths."""
    groups = [inputs]
    if data.mixture:
        groups = [[(str(f), 0, None) for f in list_inputs(c.paths, corpus_view(data, c).format)]
                  for c in data.mixture]
    if data.val_paths:
        groups.append([(str(f), 0, None) for f in val_files(data)])
    return groups


def _group_views(data: DataConfig) -> list[DataConfig]:
    """How each of `_input_groups` is read: each corpus as its own format and text key."""
    views = [corpus_view(data, c) for c in data.mixture] or [data]
    return views + ([data] if data.val_paths else [])


def _plan(data: DataConfig, streams: list[Stream]) -> tuple[dict, dict]:
    """The splits' segments (hpctrain.data.mixture) and what meta.json reports of them."""
    val = streams.pop() if data.val_paths else None
    if data.mixture:
        plan, corpora = mixture_plan(streams, val_fraction=data.val_fraction, val=val)
        for i, (corpus, row) in enumerate(zip(data.mixture, corpora, strict=True)):
            row.update(name=corpus_name(corpus, i), paths=list(corpus.paths))
        return plan, {"mixture": corpora}
    n_train = split_sizes(streams[0].tokens, data.val_fraction)[0]
    return single_plan(streams[0], n_train=n_train, val=val), {}


def _meta(data: DataConfig, encoder, stats: ShardStats, files: dict, *, dtype: str) -> dict:
    return {"dtype": dtype, "train_tokens": files["train.bin"]["tokens"],
            "val_tokens": files["val.bin"]["tokens"],
            "vocab_size": encoder.vocab_size, "eod": encoder.eod_id, "bos": encoder.bos_id,
            "eod_token": encoder.eod_token, "bos_token": encoder.bos_token,
            "tokenizer": data.tokenizer, "tokenizer_sha256": encoder.sha256,
            "documents": stats.documents, "skipped_empty": stats.empty,  # in the inputs
            "skipped_bad": stats.bad, "input_bytes": stats.input_bytes,
            "source": data.source, "format": input_format(data),
            "val_from": "val_paths" if data.val_paths else "val_fraction",
            "train_documents": files["train.idx"]["documents"],
            "val_documents": files["val.idx"]["documents"]}


def _units(data: DataConfig, inputs: list[Input], shard_dir: Path, spec: TokenizerSpec,
           dtype: str, *, first: int = 0) -> list[Unit]:
    """Consecutive inputs grouped until each group holds ≥ data.shard_bytes, a plain JSON Lines
    file larger than that cut into ranges of data.shard_bytes first (deterministic: it depends
    on the inputs only, never on data.workers)."""
    groups: list[list[Input]] = [[]]
    size = 0
    for piece in _pieces(inputs, data):
        if size >= data.shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += input_bytes(piece)
    groups = [g for g in groups if g]
    return [Unit(first + i, tuple(g), str(shard_dir), input_format(data), data.text_key,
                 data.on_bad_record, spec, dtype) for i, g in enumerate(groups)]


def _pieces(inputs: list[Input], data: DataConfig) -> list[Input]:
    out = []
    for path, start, stop in inputs:
        end = os.path.getsize(path) if stop is None else stop
        if end - start <= data.shard_bytes or not splittable(Path(path), input_format(data)):
            out.append((path, start, stop))
            continue
        out += [(path, a, min(a + data.shard_bytes, end))
                for a in range(start, end, data.shard_bytes)]
    return out


def _run_units(units: list[Unit], *, workers: int) -> ShardStats:
    """Every unit's shard, in processes when workers > 1; progress lines while they run."""
    todo = [u for u in units if finished(u) is None]
    total, progress = ShardStats(), _Progress(units)
    for u in units:
        if u not in todo:
            total.add(finished(u))
    if len(todo) < len(units):
        log.info("resuming prepare: %d of %d shards already done", len(units) - len(todo),
                 len(units))
    try:
        if workers <= 1 or len(todo) <= 1:
            for unit in todo:
                progress.update(total, write_shard(unit))
        else:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(min(workers, len(todo))) as pool:
                for stats in pool.imap(write_shard, todo):
                    progress.update(total, stats)
    except KeyboardInterrupt:
        log.warning("prepare interrupted: %d finished shards kept in %s; run again to resume",
                    sum(finished(u) is not None for u in units), units[0].out_dir)
        raise
    if total.bad:
        log.warning("skipped %d bad records (data.on_bad_record=skip), e.g. %s", total.bad,
                    "; ".join(total.bad_examples[:3]))
    return total


class _Progress:
    """Progress lines (documents/s, tokens/s, share of input bytes, ETA) via logging."""

    def __init__(self, units: list[Unit]):
        self.start = self.last = time.monotonic()
        self.total_bytes = sum(input_bytes(item) for u in units for item in u.files)
        self.docs = self.tokens = self.bytes = 0

    def update(self, total: ShardStats, stats: ShardStats) -> None:
        total.add(stats)
        self.docs += stats.documents
        self.tokens += stats.tokens
        self.bytes += stats.input_bytes
        now = time.monotonic()
        if now - self.last < PROGRESS_S:
            return
        self.last, elapsed = now, max(now - self.start, 1e-9)
        share = self.bytes / max(self.total_bytes, 1)
        eta = elapsed * (1 - share) / max(share, 1e-9)
        log.info("prepare: %.1f%% of %.3g MB, %.0f docs/s, %.0f tokens/s, ETA %.0f s",
                 100 * share, self.total_bytes / 1e6, self.docs / elapsed, self.tokens / elapsed,
                 eta)


def _summary(stats: ShardStats, out: Path, *, seconds: float) -> None:
    log.info("prepared %d documents, %d tokens (skipped %d empty, %d bad) from %d bytes in "
             "%.1f s into %s", stats.documents, stats.tokens, stats.empty, stats.bad,
             stats.input_bytes, seconds, out)

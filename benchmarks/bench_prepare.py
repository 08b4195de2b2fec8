"""Data preparation (issue 24): tokens/s per worker and peak memory of hpctrain's `prepare`
with a Hugging Face tokenizer against `datasets.Dataset.map(num_proc=N)` with the same
tokenizer on the same files, side by side in one run.

Corpus: synthetic JSON Lines (seeded): pseudo-English words of a fixed vocabulary drawn with
Zipf frequencies, sentences, commas and paragraphs, document lengths log-normal (median ~250
words); `--mb` in all over `--files` files. Tokenizer: a byte-level BPE of `--vocab` ids
trained once with `tokenizers` on the first `--train-mb` of it (end of text `<|endoftext|>`,
no beginning-of-text token), the same tokenizer.json for both sides. Per N in `--workers`,
each side in its own fresh spawned process (1 thread per process, TOKENIZERS_PARALLELISM=false
so a worker's encode_batch uses one core as hpctrain's encode does), into a fresh cache:

  hpctrain   `prepare(data)`: data.format=jsonl, data.tokenizer=hf, data.workers=N (its other
             settings the defaults, e.g. data.shard_bytes: units of work of ≥ 64 MB of input;
             `--shard-mb` changes it); writes train/val .bin (uint16 ids) and .idx
  datasets   `load_dataset("json", data_files=..., split="train", num_proc=N)` (the Arrow
             conversion, cached on disk as a user's would be), then `.map(encode_batch,
             batched=True, num_proc=N, remove_columns=[...])` → an `ids` column (int64 lists)

Times: wall seconds of the whole call (datasets: load + map; map alone too). tokens/s counts
the tokenizer's ids without hpctrain's framing (hpctrain adds eod, and bos when the tokenizer
has one, per document), the same number for both sides; per worker: ÷ N. Memory: peak
resident bytes (ru_maxrss) of the side's main process and of its largest worker process
(RUSAGE_CHILDREN), and the largest sum of proportional set sizes (Pss: shared pages split
between the processes sharing them, so forked workers are not counted twice) of the process
and all its descendants, sampled every 0.2 s. Correctness: both sides' token and document
counts agree, and the first documents' framed ids hash the same.

    python benchmarks/bench_prepare.py --mb 120 --files 8 --workers 1,2 --write  # ~5 min, 2 cores
    python benchmarks/bench_prepare.py --mb 1 --files 2 --workers 1,2 --vocab 2000 \\
        --train-mb 1 --shard-mb 0.25                       # toy size (the smoke test)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from functools import lru_cache, partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.host import gib, host_line  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "prepare.md"
EOT = "<|endoftext|>"
CHECK_DOCS = 1000  # documents whose framed ids both sides hash
SYLLABLES = ("ta", "re", "mon", "ka", "li", "ser", "o", "an", "ti", "vel", "qu", "ar", "es",
             "in", "dor", "pe", "la", "un", "st", "ro", "mi", "e", "th", "ing", "cal", "ber",
             "ne", "ous", "for", "gh", "y", "ment", "é", "ü", "wa", "ch")


# -- the corpus -------------------------------------------------------------------------------
def word_table(rng: np.random.Generator, words: int) -> np.ndarray:
    """Each word in 8 forms (variant v = capital·4 + ending): endings '', ',', '.',
    '.\\n\\n' (a paragraph), capital: after a sentence's end. Index v·words + rank."""
    lengths = rng.integers(1, 5, words)
    parts = np.array(SYLLABLES, dtype=object)[rng.integers(0, len(SYLLABLES), (words, 4))]
    base = ["".join(row[:n]) for row, n in zip(parts.tolist(), lengths, strict=True)]
    base[:10] = ["the", "of", "and", "to", "a", "in", "is", "that", "for", "it"]
    numbers = rng.integers(0, 3000, words // 50)
    for i, n in zip(rng.choice(words, len(numbers), replace=False), numbers, strict=True):
        base[i] = str(n)
    forms = [w + end for cap in (False, True) for end in ("", ",", ".", ".\n\n")
             for w in ([b.capitalize() for b in base] if cap else base)]
    return np.array(forms, dtype=object)


def document(rng: np.random.Generator, table: np.ndarray, cdf: np.ndarray) -> str:
    """One document: log-normal length (median ~250 words), Zipf word ranks (`cdf`: their
    cumulative probabilities)."""
    n = int(np.clip(rng.lognormal(5.5, 1.0), 5, 20000))
    words = len(cdf)
    rank = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), words - 1)
    u = rng.random(n)
    ending = np.where(u < 0.06, 2, np.where(u < 0.12, 1, 0))
    ending[(ending == 2) & (rng.random(n) < 0.15)] = 3
    ending[-1] = 2
    capital = np.concatenate([[1], ending[:-1] >= 2])
    text = " ".join(table[(capital * 4 + ending) * words + rank])
    return text.replace("\n\n ", "\n\n")


def write_corpus(out: Path, *, mb: float, files: int, seed: int, words: int = 50000) -> dict:
    """`files` JSON Lines files of ~mb/files MB each: {"id": i, "text": ...} per line."""
    rng = np.random.default_rng(seed)
    table = word_table(rng, words)
    probs = 1.0 / np.arange(1, words + 1) ** 1.07
    cdf = np.cumsum(probs / probs.sum())
    out.mkdir(parents=True, exist_ok=True)
    per_file, docs, paths = mb * 1e6 / files, 0, []
    for k in range(files):
        path = out / f"part-{k:03d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            size = 0
            while size < per_file:
                line = json.dumps({"id": docs, "text": document(rng, table, cdf)}) + "\n"
                f.write(line)
                size += len(line)
                docs += 1
        paths.append(str(path))
    return {"paths": paths, "documents": docs,
            "bytes": sum(os.path.getsize(p) for p in paths)}


def train_tokenizer(paths: list[str], out: Path, *, vocab: int, train_mb: float) -> dict:
    """A byte-level BPE (as GPT-2's) of `vocab` ids trained on the first `train_mb` MB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        seen = 0
        for p in paths:
            with open(p, encoding="utf-8") as f:
                for line in f:
                    if seen >= train_mb * 1e6:
                        return
                    seen += len(line)
                    yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.perf_counter()
    tok.train_from_iterator(texts(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return {"s": time.perf_counter() - t0, "vocab": tok.get_vocab_size()}


# -- one side in a fresh process --------------------------------------------------------------
def _peaks() -> dict:
    return {"main_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "worker_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def _child_entry(fn, args, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                      RAYON_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    result = fn(*args)
    Path(out).write_text(json.dumps({**result, **_peaks()}))


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (each thread's children: /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass  # the task ended meanwhile
    return found


def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """The largest Σ Pss over a process tree, sampled every `every` seconds until stopped."""

    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak, self.halt = pid, every, 0, threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.peak = max(self.peak, sum(_pss(p) for p in _tree(self.pid)))
            self.halt.wait(self.every)


def in_child(fn, *args) -> dict:
    """fn(*args) in a fresh spawned process: its JSON result, its peaks and the sampled Pss."""
    with tempfile.TemporaryDirectory(prefix="bench-prep-") as tmp:
        out = os.path.join(tmp, "result.json")
        proc = multiprocessing.get_context("spawn").Process(target=_child_entry,
                                                            args=(fn, args, out))
        proc.start()
        sampler = TreeSampler(proc.pid)
        sampler.start()
        proc.join()
        sampler.halt.set()
        sampler.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{fn.__name__} exited with {proc.exitcode}")
        return {**json.loads(Path(out).read_text()), "tree_pss": sampler.peak}


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _hash_ids(ids: np.ndarray) -> str:
    return hashlib.sha256(ids.astype("<u4").tobytes()).hexdigest()[:16]


# -- hpctrain ---------------------------------------------------------------------------------
def hpctrain_side(paths: list[str], tok_dir: str, cache: str, workers: int,
                  shard_mb: float | None) -> dict:
    """prepare() timed, then its meta.json/manifest.json and the first documents' hash."""
    from hpctrain.config.build import build
    from hpctrain.config.schema import DataConfig
    from hpctrain.data.prepare import prepare

    values = {"source": "files", "paths": list(paths), "format": "jsonl", "tokenizer": "hf",
              "tokenizer_path": tok_dir, "workers": workers, "cache_dir": cache}
    if shard_mb is not None:
        values["shard_bytes"] = int(shard_mb * 1e6)
    data = build(DataConfig, "data", values)
    t0 = time.perf_counter()
    out = prepare(data)
    seconds = time.perf_counter() - t0
    meta = json.loads((out / "meta.json").read_text())
    framing = 1 + (meta["bos"] is not None)
    return {"s": seconds, "framed_tokens": meta["train_tokens"] + meta["val_tokens"],
            "tokens": meta["train_tokens"] + meta["val_tokens"] - framing * meta["documents"],
            "documents": meta["documents"], "bos": meta["bos"], "eod": meta["eod"],
            "units": json.loads((out / "manifest.json").read_text())["shards"],
            "check": _hash_ids(_first_documents(out, meta)), "out_bytes": _du(out)}


def _first_documents(out: Path, meta: dict) -> np.ndarray:
    """The framed ids of the first CHECK_DOCS documents of the token stream (train then val:
    the split cuts the stream, possibly inside a document)."""
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    ends = np.concatenate([np.fromfile(out / "train.idx", dtype="<i8"),
                           np.fromfile(out / "val.idx", dtype="<i8") + meta["train_tokens"]])
    need = int(ends[min(CHECK_DOCS, len(ends)) - 1]) + 1
    train = np.fromfile(out / "train.bin", dtype=dtype, count=min(need, meta["train_tokens"]))
    rest = need - len(train)
    return np.concatenate([train, np.fromfile(out / "val.bin", dtype=dtype, count=rest)
                           if rest else train[:0]])


# -- datasets ---------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _encode(batch: dict, *, path: str) -> dict:
    encodings = _tokenizer(path).encode_batch(batch["text"], add_special_tokens=False)
    return {"ids": [e.ids for e in encodings]}


def datasets_side(paths: list[str], tok_dir: str, cache: str, workers: int, bos: int | None,
                  eod: int) -> dict:
    """load_dataset (Arrow conversion) and map timed; then counts and the first documents'
    ids framed as hpctrain frames them, hashed."""
    os.environ["HF_DATASETS_CACHE"] = cache
    import datasets
    import pyarrow.compute as pc

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    nproc = workers if workers > 1 else None
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=list(paths), split="train", cache_dir=cache,
                               num_proc=nproc)
    t1 = time.perf_counter()
    out = ds.map(partial(_encode, path=str(Path(tok_dir) / "tokenizer.json")), batched=True,
                 num_proc=nproc, remove_columns=ds.column_names)
    t2 = time.perf_counter()
    ids = out.data.column("ids")
    head = [] if bos is None else [bos]
    k = min(CHECK_DOCS, len(out))
    first = np.concatenate([np.array([*head, *r, eod]) for r in out[:k]["ids"]])
    return {"s": t2 - t0, "load_s": t1 - t0, "map_s": t2 - t1, "documents": len(out),
            "tokens": int(pc.sum(pc.list_value_length(ids)).as_py()),
            "check": _hash_ids(first), "out_bytes": _du(Path(cache))}


# -- report -----------------------------------------------------------------------------------
def _row(n: int, side: str, r: dict, tokens: int, parts: str, notes: str) -> str:
    rate = tokens / r["s"]
    return (f"| {n} | {side} | {r['s']:.2f} | {parts} | {rate / 1e6:.3f} | {rate / n / 1e6:.3f} "
            f"| {gib(r['main_peak'])} | {gib(r['worker_peak']) if n > 1 else '–'} | "
            f"{gib(r['tree_pss'])} | {r['out_bytes'] / 2**20:.0f} | {notes} |")


def table(results: dict[int, dict]) -> list[str]:
    lines = ["| N | side | total (s) | load / map (s) | M tokens/s | M tokens/s per worker | "
             "peak main process (GiB) | peak largest worker (GiB) | sampled peak Σ Pss "
             "(GiB) | output (MiB) | notes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, r in results.items():
        ours, hf = r["hpctrain"], r["datasets"]
        lines.append(_row(n, "hpctrain prepare", ours, ours["tokens"], "–",
                          f"{ours['units']} unit(s) of work; uint16 ids + index"))
        lines.append(_row(n, "datasets load+map", hf, hf["tokens"],
                          f"{hf['load_s']:.2f} / {hf['map_s']:.2f}",
                          f"map alone {hf['tokens'] / hf['map_s'] / 1e6:.3f} M tokens/s; "
                          "Arrow cache of the text + int64 ids"))
    return lines


def ratios(results: dict[int, dict]) -> list[str]:
    first = next(iter(results))
    base = results[first]
    lines = ["| N | hpctrain / datasets (load+map) | hpctrain / datasets (map alone) | "
             f"hpctrain speed-up over N={first} | datasets speed-up over N={first} |",
             "|---|---|---|---|---|"]
    for n, r in results.items():
        ours, hf = r["hpctrain"], r["datasets"]
        lines.append(f"| {n} | {hf['s'] / ours['s']:.2f}× | {hf['map_s'] / ours['s']:.2f}× | "
                     f"{base['hpctrain']['s'] / ours['s']:.2f}× | "
                     f"{base['datasets']['s'] / hf['s']:.2f}× |")
    return lines


def checks(results: dict[int, dict]) -> tuple[list[str], bool]:
    lines, ok = ["### Correctness"], True
    for n, r in results.items():
        ours, hf = r["hpctrain"], r["datasets"]
        same = (ours["tokens"], ours["documents"], ours["check"]) == (
            hf["tokens"], hf["documents"], hf["check"])
        ok &= same
        lines.append(f"- N={n}: {'same' if same else 'DIFFERENT'}: hpctrain "
                     f"{ours['framed_tokens']:,} framed tokens − {ours['documents']:,} documents "
                     f"× framing = {ours['tokens']:,}; datasets {hf['tokens']:,} ids in "
                     f"{hf['documents']:,} rows; first {min(CHECK_DOCS, hf['documents'])} "
                     f"documents' framed ids sha256 {ours['check']} vs {hf['check']}")
    return lines, ok


# -- main -------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=200.0, help="corpus size in MB (default 200)")
    p.add_argument("--files", type=int, default=8, help="JSON Lines files (default 8)")
    p.add_argument("--workers", default="1,2", help="comma-separated N (default 1,2)")
    p.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary (default 32000)")
    p.add_argument("--train-mb", type=float, default=20.0,
                   help="MB of the corpus the tokenizer is trained on (default 20)")
    p.add_argument("--shard-mb", type=float, default=None,
                   help="hpctrain's data.shard_bytes in MB (default: hpctrain's, 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default=None, help="where the corpus and caches go")
    p.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    return p.parse_args()


def run(args: argparse.Namespace, tmp: Path) -> tuple[dict, dict, dict[int, dict]]:
    t0 = time.perf_counter()
    corpus = write_corpus(tmp / "corpus", mb=args.mb, files=args.files, seed=args.seed)
    corpus["s"] = time.perf_counter() - t0
    tok = train_tokenizer(corpus["paths"], tmp / "tok", vocab=args.vocab,
                          train_mb=args.train_mb)
    results: dict[int, dict] = {}
    for i, n in enumerate(int(w) for w in args.workers.split(",")):
        sides = {}
        for side in (("hpctrain", "datasets") if i % 2 == 0 else ("datasets", "hpctrain")):
            cache = tmp / f"cache-{side}-{n}"
            if side == "hpctrain":
                sides[side] = in_child(hpctrain_side, corpus["paths"], str(tmp / "tok"),
                                       str(cache), n, args.shard_mb)
            else:  # bos/eod: the tokenizer's, as hpctrain resolves them (none / <|endoftext|>)
                ids = _special_ids(tmp / "tok")
                sides[side] = in_child(datasets_side, corpus["paths"], str(tmp / "tok"),
                                       str(cache), n, *ids)
            shutil.rmtree(cache, ignore_errors=True)
        results[n] = {"hpctrain": sides["hpctrain"], "datasets": sides["datasets"]}
    return corpus, tok, results


def _special_ids(tok_dir: Path) -> tuple[int | None, int]:
    from hpctrain.data.tokenizer import TokenizerSpec, load

    enc = load(TokenizerSpec("hf", str(tok_dir)))
    return enc.bos_id, enc.eod_id


def report(args, corpus: dict, tok: dict, results: dict[int, dict], *, t0: float,
           loads: tuple[float, float]) -> tuple[str, bool]:
    check, ok = checks(results)
    n_tokens = next(iter(results.values()))["hpctrain"]["tokens"]
    lines = ["# Data preparation: hpctrain prepare vs datasets.map", "",
             f"Command: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}` "
             f"({time.time() - t0:.0f} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", host_line("tokenizers", "datasets"),
             f"load average at start {loads[0]:.2f}, at end {loads[1]:.2f}",
             "", f"corpus: {corpus['bytes'] / 1e6:.1f} MB of synthetic JSON Lines in "
             f"{args.files} files, {corpus['documents']:,} documents, {n_tokens:,} tokens "
             f"(generated in {corpus['s']:.0f} s); tokenizer: byte-level BPE of {tok['vocab']:,} "
             f"ids trained on {args.train_mb:g} MB in {tok['s']:.0f} s; each side a fresh "
             "process, 1 thread per process; tokens/s: the tokenizer's ids (no framing)", "",
             *table(results), "", "### Ratios (time of datasets / time of hpctrain: > 1 means "
             "hpctrain is faster)", *ratios(results), "", *check]
    return "\n".join(lines) + "\n", ok


def main() -> None:
    args = parse_args()
    t0, load0 = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-prep-", dir=args.tmp) as tmp:
        corpus, tok, results = run(args, Path(tmp))
    text, ok = report(args, corpus, tok, results, t0=t0, loads=(load0[0], os.getloadavg()[0]))
    print(text)
    if args.write:
        RESULTS.write_text(text)
        print(f"written to {RESULTS}")
    if not ok:
        raise SystemExit("the two sides' tokens differ (see Correctness)")


if __name__ == "__main__":
    main()

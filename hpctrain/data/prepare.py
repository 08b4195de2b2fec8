"""Tokenise text into the memmap token layout: `train.bin`/`val.bin` + `meta.json`.

Layout: a flat little-endian uint16 (vocab ≤ 65536) or uint32 array of token ids, documents
joined by an end-of-document token. `meta.json` records dtype, counts, tokenizer and sources;
`train.idx`/`val.idx` are the document index (int64 offsets of the eod tokens,
hpctrain.data.packing) that dynamic batching reads.
A prepared directory is keyed by a hash of its inputs, written to a temporary name and renamed
into place, so concurrent or interrupted runs never see a half-written dataset.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path

import numpy as np

from hpctrain.config import DataConfig
from hpctrain.data.packing import build_document_index, write_document_index

log = logging.getLogger(__name__)
BYTE_EOD = 256  # byte-level vocabulary: 0..255 are bytes, 256 ends a document


def source_files(data: DataConfig) -> list[Path]:
    """The text files to tokenise, in a deterministic order."""
    if data.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    files = {Path(f) for pat in data.paths for f in glob.glob(os.path.expanduser(pat))}
    return sorted(p for p in files if p.is_file())


def _read_documents(files: list[Path], max_bytes: int) -> list[bytes]:
    docs, total = [], 0
    for path in files:
        if total >= max_bytes:
            break
        text = path.read_bytes()[: max_bytes - total]
        docs.append(text)
        total += len(text)
    return docs


def _cache_key(data: DataConfig, files: list[Path]) -> str:
    h = hashlib.sha256()
    for part in (data.source, data.tokenizer, data.bpe_vocab_size, data.max_bytes,
                 data.val_fraction):
        h.update(repr(part).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def _tokenize_bytes(docs: list[bytes]) -> tuple[np.ndarray, int]:
    parts = []
    for d in docs:
        parts.append(np.frombuffer(d, dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([BYTE_EOD], dtype=np.uint16))
    return np.concatenate(parts), BYTE_EOD


def _tokenize_bpe(docs: list[bytes], vocab_size: int, out_dir: Path) -> tuple[np.ndarray, int]:
    # Optional (the `bpe` extra): only data.tokenizer=bpe needs it.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eod|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [d.decode("utf-8", errors="replace") for d in docs]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    eod = tok.token_to_id("<|eod|>")
    ids = [np.array(e.ids + [eod], dtype=np.uint32) for e in tok.encode_batch(texts)]
    return np.concatenate(ids), eod


def tokenizer_vocab(data: DataConfig) -> int:
    """Token ids the tokenizer of `data` produces (a model needs at least this vocab_size)."""
    return data.bpe_vocab_size if data.tokenizer == "bpe" else BYTE_EOD + 1


def split_sizes(n_tokens: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) token counts of a prepared dataset of n_tokens; val holds at least one."""
    n_val = max(1, int(n_tokens * val_fraction))
    return n_tokens - n_val, n_val


def predicted_split(data: DataConfig) -> tuple[int, int] | None:
    """The (train, val) token counts `prepare` will produce, computed from file sizes without
    reading them; None where that needs more (BPE, or listing the whole stdlib)."""
    if data.source != "files" or data.tokenizer != "byte":
        return None
    total = docs = 0
    for path in source_files(data):  # as _read_documents: every file is a document + EOD
        if total >= data.max_bytes:
            break
        total += min(path.stat().st_size, data.max_bytes - total)
        docs += 1
    return split_sizes(total + docs, data.val_fraction)


def cached_dir(data: DataConfig) -> Path | None:
    """The prepared directory of `data` if it is already in the cache, else None."""
    files = source_files(data) if data.source != "tokens" else []
    out = _out_dir(data, files)
    return out if files and (out / "meta.json").exists() else None


def _out_dir(data: DataConfig, files: list[Path]) -> Path:
    return Path(os.path.expanduser(data.cache_dir)) / "data" / _cache_key(data, files)


def prepare(data: DataConfig) -> Path:
    """Return the prepared token directory for `data`, building it if needed."""
    if data.source == "tokens":
        return Path(os.path.expanduser(data.paths[0]))
    files = source_files(data)
    if not files:
        raise ValueError(f"data.source={data.source}: no text files found "
                         f"(data.paths={data.paths})")
    out = _out_dir(data, files)
    if (out / "meta.json").exists():
        return out
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    docs = _read_documents(files, data.max_bytes)
    if data.tokenizer == "bpe":
        tokens, eod = _tokenize_bpe(docs, data.bpe_vocab_size, tmp)
    else:
        tokens, eod = _tokenize_bytes(docs)
    vocab = tokenizer_vocab(data)
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    tokens = tokens.astype(dtype)
    n_train, n_val = split_sizes(len(tokens), data.val_fraction)
    tokens[:n_train].tofile(tmp / "train.bin")
    tokens[n_train:].tofile(tmp / "val.bin")
    ends = {}  # the document index of each split: offsets of its eod tokens (data.packing)
    for split, part in (("train", tokens[:n_train]), ("val", tokens[n_train:])):
        offsets = build_document_index(part, eod=int(eod))
        write_document_index(tmp / f"{split}.idx", offsets)
        ends[f"{split}_documents"] = len(offsets)
    meta = {"dtype": np.dtype(dtype).name, "train_tokens": n_train,
            "val_tokens": n_val, "vocab_size": vocab, "eod": int(eod),
            "tokenizer": data.tokenizer, "documents": len(docs), "source": data.source, **ends}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its copy is identical
        log.info("prepared data already present at %s", out)
    log.info("prepared %d tokens from %d files into %s", len(tokens), len(docs), out)
    return out

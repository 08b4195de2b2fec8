"""The tokenizers of data.tokenizer behind one interface: byte | hf | tiktoken (bpe is trained
locally by prepare, then read as hf).

A document is encoded without special tokens — hf: `Tokenizer.encode(text,
add_special_tokens=False).ids`; tiktoken: `Encoding.encode_ordinary(text)`; byte: its UTF-8
bytes — and framed by hpctrain: [bos] ids [eod]. bos defaults to the tokenizer's
beginning-of-text token if it has one (data.bos_token='' for none), eod to its end-of-text
token (required for tiktoken, whose files name none). `sha256` is the tokenizer file's hash,
recorded in meta.json with both special tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from hpctrain.errors import read_json

BYTE_EOD = 256  # byte-level vocabulary: 0..255 are bytes, 256 ends a document
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|eod|>")
EXTRA = "pip install 'hpctrain[data]'"


@dataclass(frozen=True)
class TokenizerSpec:
    """What to load (picklable: prepare's worker processes load their own copy)."""

    kind: str  # byte | hf | tiktoken
    path: str | None = None
    bos_token: str | None = None  # None: the tokenizer's own, '': none
    eod_token: str | None = None  # None: the tokenizer's own


@dataclass
class Encoder:
    """A loaded tokenizer: `frame(text)` gives a document's token ids, [bos] ids [eod]."""

    kind: str
    vocab_size: int
    eod_id: int
    bos_id: int | None
    eod_token: str | None
    bos_token: str | None
    sha256: str
    impl: object = None

    def frame(self, text: str | bytes) -> np.ndarray:
        head = [] if self.bos_id is None else [self.bos_id]
        return np.concatenate([np.array(head, np.uint32), self.encode(text),
                               np.array([self.eod_id], np.uint32)])

    def encode(self, text: str | bytes) -> np.ndarray:
        """The ids of `text` without special tokens (a document's, before framing)."""
        if self.kind == "byte":
            raw = text.encode("utf-8") if isinstance(text, str) else text
            return np.frombuffer(raw, dtype=np.uint8).astype(np.uint32)
        if self.kind == "hf":
            return np.asarray(self.impl.encode(text, add_special_tokens=False).ids, np.uint32)
        return np.asarray(self.impl.encode_ordinary(text), dtype=np.uint32)

    def decode(self, ids) -> str:
        """The text of token ids of this tokenizer's vocabulary. byte: the bytes as UTF-8, a
        sequence that is not valid UTF-8 (a cut character) shown as U+FFFD; ids past the bytes
        (end of document, padding rows) dropped."""
        if self.kind == "byte":
            return bytes(int(i) for i in ids if i < BYTE_EOD).decode("utf-8", errors="replace")
        return self.impl.decode(list(ids))

    @property
    def wants_text(self) -> bool:
        """True when documents must be str (bytes of a text file are decoded first)."""
        return self.kind != "byte"


def load(spec: TokenizerSpec) -> Encoder:
    """The encoder of `spec`; ValueError naming the data.* key and the fix when the file,
    the package or a special token is missing."""
    if spec.kind == "byte":
        return _byte(spec)
    path = Path(spec.path or "").expanduser()
    if spec.kind == "hf" and path.is_dir():
        path = path / "tokenizer.json"
    if not spec.path or not path.is_file():
        example = ("<dir with tokenizer.json>" if spec.kind == "hf"
                   else "<dir>/cl100k_base.tiktoken")
        what = (f"data.tokenizer={spec.kind} needs data.tokenizer_path" if not spec.path else
                f"data.tokenizer_path={spec.path}: no such file (data.tokenizer={spec.kind})")
        raise ValueError(f"{what}: set data.tokenizer_path={example}")
    stat = path.stat()
    return _cached(spec, str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _cached(spec: TokenizerSpec, path: str, size: int, mtime_ns: int) -> Encoder:
    return _hf(spec, Path(path)) if spec.kind == "hf" else _tiktoken(spec, Path(path))


def _byte(spec: TokenizerSpec) -> Encoder:
    for key in ("bos_token", "eod_token"):
        if getattr(spec, key):
            raise ValueError(f"data.{key}={getattr(spec, key)!r}: data.tokenizer=byte has no "
                             f"named tokens (it ends documents with id {BYTE_EOD}): remove "
                             f"data.{key}")
    return Encoder("byte", BYTE_EOD + 1, BYTE_EOD, None, None, None, "byte")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hf(spec: TokenizerSpec, path: Path) -> Encoder:
    try:
        from tokenizers import Tokenizer  # optional: the `data` extra
    except ImportError as err:
        raise ValueError(f"data.tokenizer=hf needs the tokenizers package: {EXTRA}") from err
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception type on a bad file
        raise ValueError(f"data.tokenizer_path={path} is not a Hugging Face tokenizer.json "
                         f"({err}): give the tokenizer.json of a model (or its directory)"
                         ) from err
    vocab = tok.get_vocab(with_added_tokens=True)
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    bos_default, eos_default = _hf_defaults(path, specials)
    choose = _Chooser(f"data.tokenizer_path={path}", vocab.get, specials)
    bos = choose("bos_token", spec.bos_token, bos_default, required=False)
    eod = choose("eod_token", spec.eod_token, eos_default, required=True)
    return Encoder("hf", max(vocab.values()) + 1, vocab[eod], None if bos is None else vocab[bos],
                   eod, bos, _sha256(path), tok)


def _hf_defaults(path: Path, specials: list[str]) -> tuple[str | None, str | None]:
    """(bos, eos) text of a tokenizer: tokenizer_config.json beside it, else the first known
    name among its special tokens."""
    config = path.with_name("tokenizer_config.json")
    found: dict[str, str | None] = {}
    if config.is_file():
        raw = read_json(config, fix="download the tokenizer again, or delete the file")
        for key in ("bos_token", "eos_token"):
            value = raw.get(key)
            found[key] = value.get("content") if isinstance(value, dict) else value
    bos = found.get("bos_token") or next((n for n in BOS_NAMES if n in specials), None)
    eos = found.get("eos_token") or next((n for n in EOS_NAMES if n in specials), None)
    return bos, eos


class _Chooser:
    """data.bos_token / data.eod_token: the given token, else the tokenizer's default."""

    def __init__(self, what: str, lookup, specials: list[str]):
        self.what, self.lookup, self.specials = what, lookup, specials

    def __call__(self, key: str, given: str | None, default: str | None, *, required: bool):
        names = ", ".join(self.specials[:12]) or "none"
        if given == "" and not required:
            return None
        token = default if given is None else given
        if token is None and required:
            raise ValueError(f"{self.what} names no end-of-document token: set data.{key}=<a "
                             f"special token> (its special tokens: {names})")
        if token is not None and self.lookup(token) is None:
            raise ValueError(f"data.{key}={token!r} is not a token of {self.what}: choose one "
                             f"of its special tokens ({names})")
        return token


def _tiktoken(spec: TokenizerSpec, path: Path) -> Encoder:
    try:
        import tiktoken  # optional: the `data` extra
        from tiktoken.load import load_tiktoken_bpe
    except ImportError as err:
        raise ValueError(f"data.tokenizer=tiktoken needs the tiktoken package: {EXTRA}") from err
    name = path.name.split(".")[0]
    pattern, specials = _openai_encoding(name)
    ranks = load_tiktoken_bpe(str(path))
    enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks,
                            special_tokens=specials)
    choose = _Chooser(f"data.tokenizer_path={path} ({name})", specials.get, list(specials))
    bos = choose("bos_token", spec.bos_token, None, required=False)
    eod = choose("eod_token", spec.eod_token, None, required=True)
    return Encoder("tiktoken", enc.n_vocab, specials[eod], specials.get(bos) if bos else None,
                   eod, bos, _sha256(path), enc)


def _openai_encoding(name: str) -> tuple[str, dict[str, int]]:
    """The split pattern and special tokens of tiktoken's own encoding `name`, read from its
    constructor without fetching its ranks (a .tiktoken file holds only the ranks)."""
    from tiktoken_ext import openai_public as op

    if name not in op.ENCODING_CONSTRUCTORS:
        known = ", ".join(op.ENCODING_CONSTRUCTORS)
        raise ValueError(f"data.tokenizer_path: a .tiktoken file holds only BPE ranks, so its "
                         f"name must say which encoding it is ({known}), e.g. "
                         f"<dir>/cl100k_base.tiktoken; got {name!r}")
    saved = op.load_tiktoken_bpe, op.data_gym_to_mergeable_bpe_ranks
    op.load_tiktoken_bpe = op.data_gym_to_mergeable_bpe_ranks = lambda *a, **k: {}
    try:
        params = op.ENCODING_CONSTRUCTORS[name]()
    finally:
        op.load_tiktoken_bpe, op.data_gym_to_mergeable_bpe_ranks = saved
    return params["pat_str"], dict(params["special_tokens"])

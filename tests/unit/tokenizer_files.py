"""Tiny tokenizer files built locally (never downloaded) for the data tests."""

from __future__ import annotations

import base64
from pathlib import Path


def hf_tokenizer_dir(root: Path, *, words: int = 40, config: dict | None = None) -> Path:
    """A directory with a word-level tokenizer.json: [UNK], <s>, </s>, <pad> then `words`
    words w0.. plus 'hello', 'world'; a post-processor that adds <s> … </s> (which
    hpctrain must not use: it frames documents itself)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["[UNK]", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate([*specials, "hello", "world", ","])}
    vocab.update({f"w{i}": len(vocab) + i for i in range(words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def tiktoken_file(path: Path) -> Path:
    """A .tiktoken rank file: the 256 bytes, then merges of a few common pairs."""
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b"or"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                            for i, t in enumerate(ranks)))
    return path

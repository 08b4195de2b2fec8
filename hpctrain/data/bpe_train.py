"""data.tokenizer=bpe: a byte-level BPE trained on the corpus itself by prepare (the `data`
extra's tokenizers library), then read like any Hugging Face tokenizer.json."""

from __future__ import annotations

import os
from pathlib import Path

from hpctrain.config.schema import DataConfig
from hpctrain.data.records import records
from hpctrain.data.shards import Input

BPE_EOD = "<|eod|>"


def train_bpe(data: DataConfig, groups: list[tuple[list[Input], str, str]], work: Path) -> None:
    """Train a byte-level BPE of data.bpe_vocab_size on the text of the inputs of each group
    (streamed, read as the group's format and text key: a mixture's corpora) into
    `work/tokenizer.json` (written whole: through a temp file and a rename)."""
    # Optional (the `data` extra): only data.tokenizer=bpe needs it.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=data.bpe_vocab_size, special_tokens=[BPE_EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for inputs, fmt, text_key in groups:
            yield from _texts(inputs, fmt, text_key)

    tok.train_from_iterator(texts(), trainer=trainer)
    tok.save(str(work / "tokenizer.json.tmp"))
    os.replace(work / "tokenizer.json.tmp", work / "tokenizer.json")


def _texts(inputs: list[Input], fmt: str, text_key: str):
    for path, start, stop in inputs:
        for rec in records(Path(path), fmt, text_key=text_key, start=start, stop=stop):
            if rec.problem is None and rec.text:  # bad records: the shard pass reports them
                t = rec.text
                yield t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t

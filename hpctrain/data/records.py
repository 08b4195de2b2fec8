"""Documents from input files, one per record: data.format = text | jsonl | parquet | hf.

- text: a whole file is one document (raw bytes).
- jsonl: one JSON object per line, the document in its `data.text_key` field; plain, gzip
  or zstandard (told by the file's first bytes, not its name). Blank lines are not records.
- parquet: the `data.text_key` column of every row (pyarrow).
- hf: a dataset saved by `datasets.Dataset.save_to_disk`, read with `datasets.load_from_disk`
  (never a hub download); the `data.text_key` column of every row.

`records(path, ...)` yields `Record(where, text, problem)`: `where` names the line or row, and
`problem` says why the record is unusable (missing key, not a string, undecodable, corrupt file)
or is None. What to do with a bad record (raise or skip and count) is the caller's choice.
Optional readers are imported inside functions: pyarrow and zstandard (the `data` extra) and
datasets (the `hf` extra) are needed only by the formats that read them.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("text", "jsonl", "parquet", "hf")
SUFFIXES = {  # what a directory of shards contributes, per format (text: every file)
    # plain .json is left out: in a directory it is more often metadata (state.json) than
    # JSON Lines; name such files explicitly or by a glob
    "jsonl": (".jsonl", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst"),
    "parquet": (".parquet",),
}
BATCH_ROWS = 1024


@dataclass(frozen=True)
class Record:
    where: str  # "line 12", "row 7", "" for a whole file
    text: str | bytes | None
    problem: str | None = None


def list_inputs(paths: tuple[str, ...], fmt: str) -> list[Path]:
    """The input files (hf: dataset directories) of `paths` — files, globs or directories of
    shards — de-duplicated, in sorted order."""
    found: set[Path] = set()
    for pattern in paths:
        for match in glob.glob(os.path.expanduser(pattern)):
            found.update(_expand(Path(match), fmt))
    return sorted(found)


def _expand(path: Path, fmt: str) -> list[Path]:
    if fmt == "hf":
        return [path] if path.is_dir() else []
    if path.is_file():
        return [path]
    suffixes = SUFFIXES.get(fmt)
    return [p for p in path.rglob("*") if p.is_file() and not p.name.startswith((".", "_"))
            and (suffixes is None or p.name.endswith(suffixes))]


MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"PAR1": "parquet"}


def content_kind(path: Path) -> str | None:
    """What a file's first bytes say it is — gzip, zstd or parquet — whatever its name
    says; None for anything else (text, JSON Lines)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return next((kind for magic, kind in MAGIC.items() if head.startswith(magic)), None)


def splittable(path: Path, fmt: str) -> bool:
    """Whether `records` can read byte ranges of this input (plain JSON Lines)."""
    return fmt == "jsonl" and content_kind(path) is None


def records(path: Path, fmt: str, *, text_key: str, start: int = 0, stop: int | None = None
            ) -> Iterator[Record]:
    """Every record of one input (module doc). text: at most `stop` bytes (the stdlib
    default's data.max_bytes cap); plain JSON Lines (`splittable`): the lines that begin in
    bytes [start, stop), so consecutive ranges read every line once."""
    if fmt == "text":
        with open(path, "rb") as f:
            yield Record("", f.read() if stop is None else _whole_chars(f.read(stop)))
    elif fmt == "jsonl" and (start or stop is not None):
        yield from _jsonl_range(path, text_key, start, stop)
    elif fmt == "jsonl":
        yield from _jsonl(path, text_key)
    elif fmt == "parquet":
        yield from _parquet(path, text_key)
    else:
        yield from _hf(path, text_key)


def _whole_chars(data: bytes) -> bytes:
    """`data` without a UTF-8 sequence cut at its end (by a byte limit)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # a lead byte: keep its sequence only if whole
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= need else data[:-back]
    return data


def _open_lines(path: Path) -> io.BufferedIOBase:
    """A JSON Lines file's bytes, decompressed by what its content is, not its name."""
    kind = content_kind(path)
    if kind == "gzip":
        return gzip.open(path, "rb")
    if kind == "zstd":
        import zstandard  # optional: the `data` extra

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"),
                                                                            closefd=True))
    return open(path, "rb")


def _jsonl(path: Path, text_key: str) -> Iterator[Record]:
    n = 0
    try:
        with _open_lines(path) as f:
            for n, line in enumerate(f, start=1):  # noqa: B007 - n names a corrupt stream
                if line.strip():
                    yield _json_record(f"line {n}", line, text_key)
    except (OSError, EOFError, zlib.error) as err:  # a corrupt or truncated .gz / .zst
        yield Record(f"line {n + 1}", None, f"unreadable compressed stream ({err})")
    except Exception as err:  # zstandard.ZstdError is not an OSError
        if type(err).__module__.startswith("zstandard"):
            yield Record(f"line {n + 1}", None, f"unreadable compressed stream ({err})")
        else:
            raise


def _jsonl_range(path: Path, text_key: str, start: int, stop: int | None) -> Iterator[Record]:
    """The lines of a plain JSON Lines file that begin in [start, stop); a bad record's line
    number is counted from the file's start (only then: it reads the bytes before)."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the end of a line that began before `start`
        first = pos = f.tell()
        base, n = None, 0
        while stop is None or pos < stop:
            line = f.readline()
            if not line:
                break
            n, pos = n + 1, pos + len(line)
            if line.strip():
                rec = _json_record("", line, text_key)
                if rec.problem is not None:
                    base = _lines_before(path, first) if base is None else base
                    rec = Record(f"line {base + n}", None, rec.problem)
                yield rec


def _lines_before(path: Path, offset: int) -> int:
    """Newlines in the first `offset` bytes of `path`."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            count, offset = count + chunk.count(b"\n"), offset - len(chunk)
    return count


def _json_record(where: str, line: bytes, text_key: str) -> Record:
    try:
        obj = json.loads(line.decode("utf-8").lstrip("\ufeff"))  # a byte-order mark
    except UnicodeDecodeError as err:
        return Record(where, None, f"not UTF-8 ({err.reason} at byte {err.start})")
    except json.JSONDecodeError as err:
        return Record(where, None, f"not valid JSON ({err.msg}, column {err.colno})")
    if not isinstance(obj, dict):
        return Record(where, None, f"a JSON {type(obj).__name__}, not an object")
    return _text_of(where, obj, text_key)


def _text_of(where: str, row: dict, text_key: str) -> Record:
    if text_key not in row:
        keys = ", ".join(map(str, list(row)[:8]))
        return Record(where, None, f"no key {text_key!r} (keys: {keys}); set data.text_key")
    value = row[text_key]
    if not isinstance(value, str):
        return Record(where, None, f"{text_key!r} is {type(value).__name__}, not a string")
    return Record(where, value)


def _parquet(path: Path, text_key: str) -> Iterator[Record]:
    import pyarrow as pa  # optional: the `data` extra
    import pyarrow.parquet as pq

    row = 0
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if text_key not in names:
            yield Record("row 0", None, f"no column {text_key!r} (columns: "
                                        f"{', '.join(names[:8])}); set data.text_key")
            return
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[text_key]):
            for value in batch.column(0).to_pylist():
                yield _value_record(f"row {row}", value, text_key)
                row += 1
    except (pa.ArrowException, OSError) as err:
        yield Record(f"row {row}", None, f"unreadable Parquet ({err})")


def _value_record(where: str, value, text_key: str) -> Record:
    if isinstance(value, str):
        return Record(where, value)
    return Record(where, None, f"{text_key!r} is {type(value).__name__}, not a string")


def _hf(path: Path, text_key: str) -> Iterator[Record]:
    import datasets  # optional: the `hf` extra

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        yield Record("", None, f"a DatasetDict with splits {', '.join(ds)}: give one split's "
                               f"directory, e.g. {path}/{next(iter(ds), 'train')}")
        return
    if text_key not in ds.column_names:
        yield Record("row 0", None, f"no column {text_key!r} (columns: "
                                    f"{', '.join(ds.column_names[:8])}); set data.text_key")
        return
    row = 0
    for batch in ds.select_columns([text_key]).iter(batch_size=BATCH_ROWS):
        for value in batch[text_key]:
            yield _value_record(f"row {row}", value, text_key)
            row += 1

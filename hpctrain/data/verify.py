"""A prepared token directory checked before any rank reads it (`check_token_dir`).

Always (cheap: stat calls): every token file's size is its token count × the dtype's size from
`meta.json`, and every file the manifest lists (`manifest.json`, written by prepare:
hpctrain.data.assemble) has the size it records. On first use, also the content: each listed
file's sha256 against the manifest (without a manifest, the token files' largest id is
measured). What was verified is remembered in `.verified.json` beside the files with their
sizes, modification and change times and inodes, so later runs only stat them; a changed file
is verified again (also one whose size and mtime were put back: its change time moved). A
directory that cannot be written (a shared, read-only cache) is verified by every run. The
largest token id must be below model.vocab_size: an id outside the embedding would fail in the
middle of training, at the first step that samples it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MARKER = ".verified.json"
TOKEN_FILES = ("train.bin", "val.bin")
_CHUNK = 1 << 24  # bytes hashed or ids scanned at a time


def check_token_dir(data_dir: Path, *, vocab_size: int, rebuild: str) -> list[str]:
    """The problems of prepared directory `data_dir` (module docstring); `rebuild` says how
    to build it again (the command or what to delete), for the messages."""
    meta = json.loads((data_dir / "meta.json").read_text())
    manifest = _read(data_dir / "manifest.json")
    files = manifest.get("files", {}) if manifest else {}
    itemsize = np.dtype(meta["dtype"]).itemsize
    errs = []
    for name, key in (("train.bin", "train_tokens"), ("val.bin", "val_tokens")):
        path = data_dir / name
        want = int(meta[key]) * itemsize
        have = path.stat().st_size if path.is_file() else None
        if have != want:
            found = "is missing" if have is None else f"holds {have:,} bytes"
            errs.append(f"prepared data {data_dir}: {name} {found}, but meta.json counts "
                        f"{int(meta[key]):,} tokens of {itemsize} bytes ({want:,} bytes): the "
                        f"cache is damaged or incomplete; {rebuild}")
    for name, entry in files.items():
        path = data_dir / name
        if name not in TOKEN_FILES and (not path.is_file() or path.stat().st_size
                                        != entry["bytes"]):
            errs.append(f"prepared data {data_dir}: {name} does not have the {entry['bytes']:,} "
                        f"bytes its manifest records: the cache is damaged; {rebuild}")
    if errs:
        return errs
    facts = _verified(data_dir, files, itemsize)
    if "damaged" in facts:
        return [f"prepared data {data_dir}: {facts['damaged']}'s content differs from its "
                f"manifest (sha256): the cache is damaged or was changed after prepare; "
                f"{rebuild}"]
    top = max(facts["max_id"].values(), default=-1)
    if top >= vocab_size:
        fix = 1 << top.bit_length()
        where = max(facts["max_id"], key=facts["max_id"].get)
        errs.append(f"prepared data {data_dir}: {where} holds token id {top}, but "
                    f"model.vocab_size={vocab_size} (ids 0..{vocab_size - 1}): set "
                    f"model.vocab_size={fix} (at least {top + 1}), or prepare the data with "
                    "this model's tokenizer")
    return errs


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _signature(data_dir: Path, names) -> dict[str, list[int]]:
    out = {}
    for name in sorted(names):
        st = (data_dir / name).stat()  # ctime: no user can set it back (utime moves it too)
        out[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return out


def _verified(data_dir: Path, files: dict[str, Any], itemsize: int) -> dict[str, Any]:
    """{"max_id": {token file: largest id}} of a directory whose content checks out, or
    {"damaged": file name}; from the marker when the files are unchanged since."""
    names = set(files) | set(TOKEN_FILES)
    signature = _signature(data_dir, names)
    marker = _read(data_dir / MARKER)
    if marker and marker.get("signature") == signature:
        return {"max_id": marker["max_id"]}
    size = sum(entry[0] for entry in signature.values())
    log.info("verifying prepared data %s (%.3g MB, first use)", data_dir, size / 1e6)
    for name, entry in sorted(files.items()):
        if _sha256(data_dir / name) != entry["sha256"]:
            return {"damaged": name}
    max_id = {name: int(files[name]["max_id"]) if name in files else
              _largest_id(data_dir / name, itemsize) for name in TOKEN_FILES}
    try:
        tmp = data_dir / f"{MARKER}.{os.getpid()}"
        tmp.write_text(json.dumps({"signature": signature, "max_id": max_id}))
        os.replace(tmp, data_dir / MARKER)
    except OSError:  # a read-only cache: verified again next time
        pass
    return {"max_id": max_id}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _largest_id(path: Path, itemsize: int) -> int:
    dtype = np.dtype(f"<u{itemsize}")
    if path.stat().st_size == 0:
        return -1
    ids = np.memmap(path, dtype=dtype, mode="r")
    step = _CHUNK // itemsize
    return max(int(ids[i:i + step].max()) for i in range(0, len(ids), step))

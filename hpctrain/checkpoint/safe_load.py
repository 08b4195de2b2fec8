"""Loading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP's stock reader unpickles `.metadata` with `pickle.load` and its planner reads non-tensor
entries with `torch.load(weights_only=False)`: a crafted file in a checkpoint directory would run
code on every rank. Here `.metadata` goes through an unpickler that only builds DCP's own
metadata classes, torch sizes/dtypes/layouts and paths, and non-tensor entries load with
`weights_only=True` (tensor data already does). Only public DCP classes are subclassed.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")


def read_metadata(path: Path) -> Metadata:
    """The DCP index `path/.metadata`; UnpicklingError for anything but DCP's own classes."""
    with open(Path(path) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, "
                                     "not DCP Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read by `read_metadata` above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # rank-local indexes: hpctrain never writes them
            raise pickle.UnpicklingError("rank-local DCP metadata is not supported")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are read with weights_only=True: the
    object is rebuilt by the safe unpickler, then handed on as our own serialisation."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)

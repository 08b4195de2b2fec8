"""DCP directories load without running code: a non-tensor entry that unpickles into a call
and a crafted `.metadata` are refused by `safe_dcp`, while the stock planner/reader would run
them (so the payloads are live); plain data and tensors still round-trip."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from hpctrain.checkpoint import safe_load


class _Payload:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _load(path: Path, state: dict, *, planner) -> None:
    dcp.load(state, storage_reader=safe_load.SafeReader(str(path)), planner=planner,
             no_dist=True)


def test_plain_entries_round_trip(tmp_path):
    saved = {"w": torch.arange(6.0).reshape(2, 3), "step": 3, "name": "abc", "lr": 0.5}
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)
    state = {"w": torch.zeros(2, 3), "step": 0, "name": "", "lr": 0.0}
    _load(tmp_path, state, planner=safe_load.SafePlanner())
    assert torch.equal(state["w"], saved["w"])
    assert (state["step"], state["name"], state["lr"]) == (3, "abc", 0.5)
    assert set(safe_load.read_metadata(tmp_path).state_dict_metadata) >= {"w"}


def test_non_tensor_entry_never_runs_code(tmp_path):
    marker = tmp_path / "marker"
    dcp.save({"w": torch.ones(2), "evil": _Payload(marker)}, checkpoint_id=str(tmp_path / "c"),
             no_dist=True)
    with pytest.raises(CheckpointException) as err:
        _load(tmp_path / "c", {"w": torch.zeros(2), "evil": None},
              planner=safe_load.SafePlanner())
    assert "Unsupported global: GLOBAL exec" in repr(err.value.failures)
    assert not marker.exists()
    _load(tmp_path / "c", {"w": torch.zeros(2), "evil": None}, planner=DefaultLoadPlanner())
    assert marker.exists()  # the stock planner unpickles it with weights_only=False


def test_crafted_metadata_never_runs_code(tmp_path):
    marker = tmp_path / "marker"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(pickle.UnpicklingError, match="builtins.exec is not part of a DCP"):
        safe_load.read_metadata(tmp_path)
    assert not marker.exists()
    with pytest.raises(CheckpointException) as err:
        _load(tmp_path, {"w": torch.zeros(2)}, planner=safe_load.SafePlanner())
    assert "builtins.exec is not part of a DCP index" in repr(err.value.failures)
    assert not marker.exists()

"""Tied embeddings with pp=2 (the real Trainer in shared worlds) equal the single process with
tied embeddings — loss and grad norm (E counted once) at each step, fp32 — when the embedding and
head are on different pp ranks (1f1b: gradients summed over the pair group; with ZeRO-1/2 through
the engine's pre_reduce) and on one rank (zbv: one Parameter). The checkpoint holds E once under
`tok_embeddings.weight`, and a pp=2 checkpoint resumes at pp=1 and pp=2 on the uninterrupted
trajectory."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint as dcp

from hpctrain.checkpoint import save_load as ckpt
from tests.conftest import get_world
from tests.parallel.trainer_runs import assert_trajectory_close, train_in_world

TIED, STOP = "model.tied_embeddings=true", 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[float, float]]:
    return get_world(1).run(train_in_world, [TIED], str(tmp_path_factory.mktemp("ref")))[0]


@pytest.mark.parametrize("extra", [["parallel.schedule=1f1b"], ["parallel.schedule=zbv"],
                                   ["parallel.schedule=zb_h1", "parallel.zero=1"],
                                   ["parallel.schedule=1f1b", "parallel.zero=2"]])
def test_pp2_tied_matches_single_process(world2, tmp_path, reference, extra):
    runs = world2.run(train_in_world, ["parallel=pp2", TIED, *extra], str(tmp_path))
    for run in runs:  # the loss is shared over the pp group: both ranks report it
        assert_trajectory_close(run, reference)


def test_pp2_tp2_tied_matches_single_process(world4, tmp_path, reference):
    """The pair groups are per tp coordinate: each vocab shard of E is summed with its own."""
    runs = world4.run(train_in_world, ["parallel=pp2", "parallel.tp=2", TIED], str(tmp_path))
    for run in runs:
        assert_trajectory_close(run, reference)


def test_pp2_tied_checkpoint_holds_e_once_and_resumes_at_pp1(world2, tmp_path, reference):
    saved = tmp_path / "saved"
    world2.run(train_in_world, ["parallel=pp2", TIED, f"train.stop_after={STOP}"], str(saved))
    path = ckpt.latest_complete(saved)
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys()
    get_world(1).run(train_in_world, [TIED, "train.stop_after=1"], str(tmp_path / "1"))
    keys1 = dcp.FileSystemReader(str(ckpt.latest_complete(tmp_path / "1"))
                                 ).read_metadata().state_dict_metadata.keys()
    model_keys = sorted(k for k in keys if k.startswith("model."))
    assert model_keys == sorted(k for k in keys1 if k.startswith("model."))  # E once, pp=1 name
    assert "model.tok_embeddings.weight" in keys
    assert not any("output.weight" in k for k in keys)
    pp1 = get_world(1).run(train_in_world, [TIED, f"train.resume={path}"], str(tmp_path / "r"))
    assert_trajectory_close(pp1[0], reference[STOP:])
    pp2 = world2.run(train_in_world, ["parallel=pp2", TIED, f"train.resume={path}"],
                     str(tmp_path / "r2"))  # torch AdamW path: E read back into both copies
    assert_trajectory_close(pp2[1], reference[STOP:])

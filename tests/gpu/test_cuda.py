"""CUDA-only paths: fused attention kernels, bf16 numerics, NCCL, MFU on a known device.

Skipped without a CUDA device; run on a GPU machine with `python -m pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

from hpctrain import dispatch
from hpctrain.metrics.logger import read_jsonl
from hpctrain.ops.attention import eager_attention, sdpa_attention
from tests.conftest import make_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_kernels_match_eager_on_cuda(dtype, tol):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (2, 8, 256, 64), (2, 2, 256, 64)
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    k = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    v = torch.randn(shape_kv, device="cuda", dtype=dtype, generator=gen, requires_grad=True)
    ref = eager_attention(q.float(), k.float(), v.float())
    out = sdpa_attention(q, k, v)
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    out.float().sum().backward()


def test_bf16_training_on_cuda_tracks_fp32(tmp_path):
    over = ["model=debug", "train=debug", "train.steps=8", "train.eval_every=0",
            "logger.wandb=disabled", "data.max_bytes=300000", "cluster.device=cuda"]
    dispatch.run(make_config(over, run_dir=tmp_path / "fp32"))
    dispatch.run(make_config([*over, "train.precision=bf16"], run_dir=tmp_path / "bf16"))
    ref = [r["loss"] for r in read_jsonl(tmp_path / "fp32" / "metrics.jsonl")]
    got = [r["loss"] for r in read_jsonl(tmp_path / "bf16" / "metrics.jsonl")]
    assert all(abs(a - b) < 0.05 * a for a, b in zip(ref, got, strict=True)), (ref, got)
    last = read_jsonl(tmp_path / "bf16" / "metrics.jsonl")[-1]
    name = torch.cuda.get_device_name()
    from hpctrain.metrics.devices import lookup_device

    if lookup_device(name) is not None:
        assert last["mfu"] is not None and 0 < last["mfu"] < 1
    assert last["mem_bytes"] > 0


def test_nccl_process_group_runs_a_training_step(tmp_path):
    over = ["model=debug", "train=debug", "train.steps=2", "train.eval_every=0",
            "logger.wandb=disabled", "data.max_bytes=300000", "cluster.backend=nccl"]
    summary = dispatch.run(make_config(over, run_dir=tmp_path))
    assert summary["completed_steps"] == 2 and summary["device"] != "cpu"


def test_a_real_cuda_oom_writes_the_allocator_snapshot(tmp_path):
    """hpctrain.launch.oom on a real CUDA out-of-memory error: the allocator's history as a
    snapshot pickle, the prediction beside it, and the message with both peaks."""
    import pickle

    from hpctrain.launch import oom

    device = torch.device("cuda", 0)
    cfg = make_config(["model=debug", "train=debug"], run_dir=tmp_path)
    oom.record(device)
    keep = torch.empty(1 << 20, device=device)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        torch.empty(1 << 50, dtype=torch.uint8, device=device)  # a petabyte
    stopped = oom.stop(cfg, caught.value, rank=0, step=7, device=device)
    assert stopped.exit_code == oom.EXIT_OOM
    assert "out of memory in step 7 on rank 0" in str(stopped) and "allocated" in str(stopped)
    snapshot = pickle.loads((tmp_path / "oom" / "rank_0_snapshot.pickle").read_bytes())
    assert snapshot["device_traces"] and snapshot["segments"]
    assert (tmp_path / "oom" / "rank_0_predicted.json").exists()
    del keep
    torch.cuda.memory._record_memory_history(enabled=None)

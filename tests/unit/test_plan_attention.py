"""The planner and the metrics know the attention backend and the document masks: no L×L
activations for fused backends, attention FLOPs from Σ lᵢ² of the real documents."""

from __future__ import annotations

import pytest
import torch

from hpctrain.metrics.throughput import batch_counts
from hpctrain.models.config import PRESETS
from hpctrain.ops.documents import IGNORE_INDEX, Documents
from hpctrain.plan.cluster import megatron_a100_cluster
from hpctrain.plan.kernels import causal_keys, roofline
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.formulas import layer_activation_bytes
from hpctrain.plan.time import step_time

MODEL = PRESETS["llama3_8b"]


@pytest.mark.parametrize("fused", ["sdpa", "flash", "triton", "flex"])
def test_fused_backends_store_no_score_matrix(fused):
    s, b, t = 8192, 1, 4
    h, a = MODEL.dim, MODEL.n_heads
    kw = dict(seq_len=s, micro_batch_size=b, tp=t)
    eager = layer_activation_bytes(MODEL.with_(attention="eager"), **kw)
    other = layer_activation_bytes(MODEL.with_(attention=fused), **kw)
    # eager keeps 5·a·s/h per token-width (softmax + mask, quadratic in s); fused the fp32 LSE
    assert eager - other == pytest.approx(s * b * h * (5 * a * s / h - 4 * a / h) / t)
    longer = layer_activation_bytes(MODEL.with_(attention=fused), **{**kw, "seq_len": 2 * s})
    assert longer == pytest.approx(2 * other)  # linear in s: nothing L×L left


def test_document_masks_cut_attention_flops():
    kw = dict(layout=Layout(dp=8), global_batch=64, micro_batch_size=1, seq_len=8192)
    cluster = megatron_a100_cluster()
    rows = step_time(MODEL, cluster, **kw)
    assert step_time(MODEL, cluster, attended_per_token=8192, **kw) == rows
    docs = step_time(MODEL, cluster, attended_per_token=1024, **kw)  # documents of 1,024
    l, h = MODEL.n_layers, MODEL.dim
    # the fused causal kernel's forward FLOPs no longer run (4·h per computed key, per token
    # and layer), and 2.5× that in its backward, at the generation's attention rates
    saved = 4 * l * h * (causal_keys(8192) - causal_keys(1024)) * 64 * 8192 / 8
    r = roofline(cluster.device, precision="bf16", achievable_fraction=cluster.achievable_fraction)
    assert rows.compute_s - docs.compute_s == pytest.approx(
        saved / r.attn_fwd + 2.5 * saved / r.attn_bwd)
    with pytest.raises(ValueError, match="attended_per_token=9000"):
        step_time(MODEL, cluster, attended_per_token=9000, **kw)


def test_batch_counts_real_tokens_documents_and_squared_lengths():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    targets = torch.ones(2, 8, dtype=torch.long)
    targets[0, 5:] = IGNORE_INDEX  # row 0: documents of 3 and 2, then 3 padding
    counts = batch_counts([(targets, targets, Documents.from_ids(ids))], group=None)
    assert (counts.tokens, counts.slots, counts.documents) == (13, 16, 3)
    assert counts.attended == 3**2 + 2**2 + 8**2
    assert counts.padding_fraction == pytest.approx(3 / 16)
    cfg = PRESETS["debug"]
    assert counts.flops(cfg) == cfg.training_flops(tokens=13, attended=77)
    assert cfg.training_flops(tokens=8, attended=64) == 8 * cfg.flops_per_token(8)
    unpacked = batch_counts([(targets, torch.ones(2, 8, dtype=torch.long))], group=None)
    assert (unpacked.documents, unpacked.attended) == (2, 2 * 64)


def test_plan_task_counts_document_tokens(tmp_path):
    """task=plan with plan.document_tokens: fewer attention FLOPs, a shorter predicted step and
    the same memory; a bad value is refused with the key."""
    from hpctrain.tasks.plan import run_plan
    from tests.conftest import make_config

    base = ["task=plan", "model=llama3_8b", "cluster.accelerator=H100-SXM",
            "cluster.procs_per_node=8", "parallel.dp=8", "train.precision=bf16",
            "train.seq_len=8192", "train.global_batch_size=64", "train.micro_batch_size=1"]
    rows = run_plan(make_config(base, run_dir=tmp_path / "rows"))
    docs = run_plan(make_config([*base, "plan.document_tokens=1024"], run_dir=tmp_path / "d"))
    assert docs["inputs"]["attended_per_token"] == 1024
    assert docs["memory_bytes"] == rows["memory_bytes"]
    assert docs["time"]["compute_s"] < rows["time"]["compute_s"]
    long_docs = run_plan(make_config([*base, "plan.document_tokens=100000"],
                                     run_dir=tmp_path / "l"))
    assert long_docs["time"] == rows["time"]  # documents longer than a row: whole rows
    with pytest.raises(ValueError, match="plan.document_tokens=0"):
        make_config([*base, "plan.document_tokens=0"], run_dir=tmp_path)

"""train.compile=blocks: compiled blocks equal eager blocks (fp32, 1e-5) on packed documents,
alone and under selective activation checkpointing; identical blocks share one graph; a new
document layout never recompiles and new shapes stop recompiling after the second step.

Inductor on CPU costs seconds per first graph: the compiled models are module-scoped, each
compiled once (tiny model: dim 32, 2 layers) and reused by the tests below."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from hpctrain.models import build_model
from hpctrain.models.checkpointing import apply_activation_checkpointing
from hpctrain.models.compile import CompileWatch, apply_compile, compile_stats
from hpctrain.models.config import ModelConfig
from hpctrain.ops.documents import Documents
from tests.conftest import make_config
from tests.references import token_batch

TOL = 1e-5
EOD = 3
CFG = ModelConfig(name="compile", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_dim=64, max_seq_len=32)


def _batch(seed: int, rows: int = 2, length: int = 16):
    """Packed rows: every seed gives another document layout."""
    inputs, targets = token_batch(rows, length, vocab=CFG.vocab_size, seed=seed)
    return inputs, targets, Documents.from_eod(inputs, eod=EOD)


def _step(model, batch):
    inputs, targets, docs = batch
    model.zero_grad()
    logits = model(inputs, docs=docs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worst(got, want) -> tuple[str, float]:
    (loss, grads), (loss_ref, grads_ref) = got, want
    errs = {"loss": float((loss - loss_ref).abs())}
    errs |= {n: float((g - grads_ref[n]).abs().max()) for n, g in grads.items()}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]


def _pair(checkpointing: str):
    """(eager, compiled) copies of one model, and the graphs compiling the latter cost."""
    eager, compiled = build_model(CFG, seed=7), build_model(CFG, seed=7)
    for model in (eager, compiled):
        apply_activation_checkpointing(model, checkpointing)
    apply_compile(compiled, "blocks", attention=CFG.attention)
    before = compile_stats().graphs
    _step(compiled, _batch(0))  # compiles here
    return eager, compiled, compile_stats().graphs - before


@pytest.fixture(scope="module")
def plain():
    return _pair("none")


@pytest.fixture(scope="module")
def selective():
    return _pair("selective")


def test_compiled_blocks_equal_eager_and_share_one_graph(plain):
    eager, compiled, graphs = plain
    assert graphs == 1, f"{CFG.n_layers} identical blocks compiled {graphs} graphs, not one"
    before = compile_stats().graphs
    for seed in range(1, 4):  # other document layouts, same shape: no recompilation
        worst, err = _worst(_step(compiled, _batch(seed)), _step(eager, _batch(seed)))
        assert err < TOL, (seed, worst, err)
    assert compile_stats().graphs == before


def test_selective_checkpointing_compiled_equals_eager(selective):
    eager, compiled, graphs = selective
    assert graphs == 1
    for seed in range(1, 3):
        worst, err = _worst(_step(compiled, _batch(seed)), _step(eager, _batch(seed)))
        assert err < TOL, (seed, worst, err)


def test_no_recompilation_after_the_second_step(plain):
    """Dynamic batching changes (rows, length) every step: the second new shape recompiles
    once with those dims dynamic, later shapes reuse it."""
    eager, compiled, _ = plain
    watch = CompileWatch(warm_steps=2)
    for seed, (rows, length) in enumerate([(3, 12), (1, 20), (2, 8), (4, 24)]):
        batch = _batch(10 + seed, rows, length)
        with watch.step():
            got = _step(compiled, batch)
        worst, err = _worst(got, _step(eager, batch))
        assert err < TOL, (rows, length, worst, err)
    assert watch.summary()["recompiles_after_warmup"] == 0, watch.summary()


def test_compile_mode_is_a_checked_choice():
    with pytest.raises(ValueError, match="did you mean train.compile=blocks"):
        make_config(["train.compile=block"])


def test_compile_with_context_parallelism_validates():
    """Composed and tested in tests/parallel/test_compat_matrix.py (cp+compile)."""
    cfg = make_config(["parallel.cp=2", "train.compile=blocks", "cluster.procs_per_node=2"])
    assert (cfg.parallel.cp, cfg.train.compile) == (2, "blocks")

"""task=generate: greedy decoding equals transformers' generate(do_sample=False) token for
token; the KV cache equals recomputing the whole row each step (tokens and logits); seeded
sampling repeats; the task writes generations.jsonl; bad settings are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint.one_device import load_one_device
from hpctrain.dispatch import launch
from hpctrain.models.decode import KVCache
from hpctrain.tasks.generate.generate import generate_ids
from hpctrain.tasks.generate.sampling import Sampling, next_token
from tests.conftest import make_config
from tests.hf_models import save_tiny_llama
from tests.unit.tokenizer_files import hf_tokenizer_dir

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

PROMPT = [1, 5, 77, 300, 12, 9, 401]
GREEDY = Sampling()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama (Llama 3.1 RoPE scaling, GQA) with a word-level tokenizer.json."""
    directory = tmp_path_factory.mktemp("hf")
    hf = save_tiny_llama(directory, tied=False)
    hf_tokenizer_dir(directory)
    return directory, hf


def _model(hf_dir, dtype=torch.float32):
    return load_one_device(init_from=str(hf_dir[0]), dtype=dtype).model


def recomputed_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The reference without a cache: the whole row through the model at every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("prompt", [PROMPT, [42]])
def test_greedy_equals_transformers_generate(hf_dir, prompt):
    hf = hf_dir[1]
    hf.generation_config.eos_token_id = None  # never stop early: compare all 20 tokens
    hf.generation_config.pad_token_id = 0
    want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                       min_new_tokens=20)[0, len(prompt):].tolist()
    got = generate_ids(_model(hf_dir), prompt, max_new_tokens=20, sampling=GREEDY)
    assert got.ids == want and got.stop == "length"


def test_greedy_equals_recomputing_without_the_cache(hf_dir):
    model = _model(hf_dir)
    got = generate_ids(model, PROMPT, max_new_tokens=24, sampling=GREEDY)
    assert got.ids == recomputed_greedy(model, PROMPT, 24)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_cached_logits_equal_the_whole_row(hf_dir, dtype, tol):
    """The prompt in two chunks (the second attends to the first from position 3 on), then
    one token a step: every position's logits equal the full forward's."""
    model = _model(hf_dir, dtype)
    ids, cache, worst, chunk = [], KVCache(len(PROMPT) + 12), 0.0, PROMPT[:3]
    with torch.no_grad():
        for step in range(14):
            ids += chunk
            got_LV = model(torch.tensor([chunk]), cache=cache)[0]
            want_LV = model(torch.tensor([ids]))[0, -len(chunk):]
            worst = max(worst, (got_LV - want_LV).abs().max().item())
            chunk = PROMPT[3:] if step == 0 else [int(got_LV[-1].argmax())]
    assert cache.pos == len(ids)
    assert worst <= tol


def test_the_cache_refuses_what_does_not_fit(hf_dir):
    model = _model(hf_dir)
    with pytest.raises(ValueError, match="the KV cache holds 4 tokens: 0 cached \\+ 5 new"):
        model(torch.tensor([PROMPT[:5]]), cache=KVCache(4))


def test_seeded_sampling_repeats_and_seeds_differ(hf_dir):
    model = _model(hf_dir)
    s = Sampling(temperature=1.0, top_k=50, top_p=0.9)

    def sample(seed):
        gen = torch.Generator().manual_seed(seed)
        return generate_ids(model, PROMPT, max_new_tokens=20, sampling=s, generator=gen).ids

    first = sample(0)
    assert sample(0) == first
    assert sample(1) != first
    assert first != generate_ids(model, PROMPT, max_new_tokens=20, sampling=GREEDY).ids


def test_top_k_1_is_greedy(hf_dir):
    model = _model(hf_dir)
    gen = torch.Generator().manual_seed(3)
    got = generate_ids(model, PROMPT, max_new_tokens=16,
                       sampling=Sampling(temperature=0.7, top_k=1), generator=gen)
    assert got.ids == generate_ids(model, PROMPT, max_new_tokens=16, sampling=GREEDY).ids


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits_1V = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    # likelier tokens hold 0, 0.5, 0.8, 0.95: top_p=0.8 keeps the first two
    drawn = next_token(logits_1V, Sampling(temperature=1.0, top_p=0.8), gen)
    assert set(drawn.tolist()) == {0, 1}
    share = (drawn == 0).float().mean().item()  # renormalised: 0.5 / 0.8
    assert abs(share - 0.625) < 0.03
    drawn = next_token(logits_1V, Sampling(temperature=1.0, top_p=0.81), gen)
    assert set(drawn.tolist()) == {0, 1, 2}
    drawn = next_token(logits_1V, Sampling(temperature=1.0, top_k=3), gen)
    assert set(drawn.tolist()) == {0, 1, 2}
    assert next_token(logits_1V[:1], Sampling(vocab=1)).tolist() == [0]
    assert next_token(torch.tensor([[0.0, 1.0, 5.0]]), Sampling(vocab=2)).tolist() == [1]


def _generate(hf_dir, tmp_path, *extra):
    return make_config(["task=generate", "model=hf", f"model.init_from={hf_dir}", *extra],
                       run_dir=tmp_path / "run")


def test_task_generate_writes_generations_jsonl(hf_dir, tmp_path):
    from hpctrain.data.tokenizer import TokenizerSpec, load
    from hpctrain.dispatch import format_result

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nw3 w4 , hello\n")
    cfg = _generate(hf_dir[0], tmp_path, f"generate.prompts_file={prompts}",
                    "generate.max_new_tokens=12")
    result = launch(cfg)
    lines = (tmp_path / "run" / "generations.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in records] == ["hello world", "w3 w4 , hello"]
    assert result["prompts"] == 2 and result["generations"] == str(tmp_path / "run" /
                                                                   "generations.jsonl")
    enc = load(TokenizerSpec("hf", str(hf_dir[0])))
    model = _model(hf_dir)
    for r in records:
        ids = [enc.bos_id, *enc.encode(r["prompt"]).tolist()]  # <s> first, as training frames
        want = generate_ids(model, ids, max_new_tokens=12, stop_id=enc.eod_id,
                            sampling=Sampling(vocab=enc.vocab_size))
        assert r["completion_ids"] == want.ids and r["stop"] == want.stop
        assert r["completion"] == enc.decode(want.ids)
        assert max(r["completion_ids"], default=0) < enc.vocab_size  # not the padded rows
    shown = format_result("generate", result)
    assert "prompt: w3 w4 , hello" in shown and "new tokens" in shown


def test_help_names_the_keys_as_typed():
    from hpctrain.config.cli import group_help

    assert group_help("generate.from").splitlines()[1] == "  generate.from = null"
    assert "  generate.top_p = 1.0   range: in (0, 1]" in group_help("generate").splitlines()


def _checkpointed_run(run, hf_dir, *, step: int = 5):
    """A run directory holding one checkpoint of the imported model, written as a one-rank
    training run writes it (DCP files + manifest with the model's shape), and the run's saved
    config naming the directory's tokenizer."""
    import torch.distributed.checkpoint as dcp

    from hpctrain.checkpoint import manifest

    loaded = load_one_device(init_from=str(hf_dir))
    path = run / "checkpoints" / f"step_{step:08d}"
    dcp.save({f"model.{k}": v for k, v in loaded.model.state_dict().items()},
             checkpoint_id=str(path), no_dist=True)
    (path / "train_state.json").write_text(json.dumps({"step": step}))
    (path / "rank_00000.pt").write_bytes(b"rng")
    files = manifest.digest_files(path, names=[f.name for f in path.iterdir()])
    manifest.write(path, files=files, step=step, layout={"dp": 1}, model=loaded.shape)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(
        f"data:\n  tokenizer: hf\n  tokenizer_path: {hf_dir}\n")
    return run


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_run_directory_generates_what_its_weights_do(hf_dir, tmp_path):
    """generate.from=<run>: its newest checkpoint and its data tokenizer give the completions
    the same weights give from the Hugging Face directory."""
    run = _checkpointed_run(tmp_path / "trained", hf_dir[0])
    common = ["generate.prompt=hello world w7", "generate.max_new_tokens=10",
              "generate.temperature=0.9", "generate.top_k=20", "generate.seed=4"]
    from_run = launch(make_config(["task=generate", f"generate.from={run}", *common],
                                  run_dir=tmp_path / "a"))
    from_hf = launch(_generate(hf_dir[0], tmp_path, *common))
    assert from_run["step"] == 5 and from_run["source"].endswith("step_00000005")
    got, want = (Path(r["generations"]).read_text() for r in (from_run, from_hf))
    assert got == want and json.loads(got)["completion_ids"]


def test_bad_settings_are_refused_by_name(hf_dir, tmp_path):
    with pytest.raises(ValueError) as err:
        _generate(hf_dir[0], tmp_path, "generate.max_new_tokens=0", "generate.temperature=-1",
                  "generate.top_k=-1", "generate.top_p=1.5", "generate.prompt=hi",
                  f"generate.prompts_file={tmp_path / 'missing.txt'}",
                  f"generate.from={tmp_path}")
    for text in ("generate.max_new_tokens=0 must be > 0", "generate.temperature=-1.0 must be",
                 "generate.top_k=-1 must be ≥ 0", "generate.top_p=1.5 must be in (0, 1]",
                 "not both (both are set)", f"generate.from={tmp_path} and model.init_from",
                 "keep one of them"):
        assert text in str(err.value)
    cases = {("generate.prompt=''",): "generate.prompt is empty",
             (f"generate.prompts_file={tmp_path / 'missing.txt'}",): "missing.txt: no such file",
             ("generate.prompt=hi", "generate.max_new_tokens=128"):
                 "generate.max_new_tokens=127 or fewer",
             ("generate.prompt=hi", "generate.top_p=0"): "generate.top_p=0.0 must be in (0, 1]"}
    for overrides, text in cases.items():
        with pytest.raises(ValueError, match=text.replace("(", "\\(").replace(")", "\\)")):
            _generate(hf_dir[0], tmp_path, *overrides)
    with pytest.raises(ValueError, match="task=generate needs a model"):
        make_config(["task=generate", "generate.prompt=hi"], run_dir=tmp_path)


def test_refusals_once_the_model_and_prompts_are_known(hf_dir, tmp_path):
    long = " ".join(["hello"] * 120)  # 121 tokens with <s>: with 10 new ones past 128
    cfg = _generate(hf_dir[0], tmp_path, f"generate.prompt='{long}'",
                    "generate.max_new_tokens=10")
    with pytest.raises(ValueError, match="prompt 1 is 121 tokens: with generate.max_new_tokens="
                                         "10 it passes the model's context of 128; set "
                                         "generate.max_new_tokens=7"):
        launch(cfg)
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    cfg = make_config(["task=generate", f"generate.from={empty_run}", "generate.prompt=hi"],
                      run_dir=tmp_path / "run")
    with pytest.raises(ValueError, match=f"generate.from={empty_run} holds no verified"):
        launch(cfg)
    bare = tmp_path / "bare"
    save_tiny_llama(bare, tied=True)
    cfg = _generate(bare, tmp_path, "generate.prompt=hi")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        launch(cfg)


def test_a_runs_tokenizer_comes_from_its_saved_config(tmp_path):
    from hpctrain.checkpoint.one_device import OneDevice
    from hpctrain.config.schema import DataConfig
    from hpctrain.tasks.generate.generate import model_tokenizer

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    loaded = OneDevice(None, None, run / "checkpoints" / "step_00000002", 2, run)
    with pytest.raises(ValueError, match="belongs to no run directory with a saved"):
        model_tokenizer(loaded, init_from=None, data=DataConfig())
    tok = hf_tokenizer_dir(tmp_path / "tok")
    (run / ".hydra" / "config.yaml").write_text(
        f"data:\n  tokenizer: hf\n  tokenizer_path: {tok}\n  bos_token: ''\n")
    enc = model_tokenizer(loaded, init_from=None, data=DataConfig())
    assert (enc.kind, enc.bos_id, enc.eod_token) == ("hf", None, "</s>")
    (run / ".hydra" / "config.yaml").write_text("data:\n  tokenizer: byte\n")
    enc = model_tokenizer(loaded, init_from=None, data=DataConfig())
    assert enc.kind == "byte" and enc.decode(list("héllo".encode())) == "héllo"
    assert enc.decode(list("é".encode())[:1]) == "\ufffd"  # a cut character

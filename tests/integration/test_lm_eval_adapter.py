"""The lm-eval adapter: its log-likelihoods equal a direct computation with the model, its
greedy flags and generations are the argmax's, and task=eval runs lm-eval offline on a local
custom task (a JSON Lines file and a task YAML written here: real tasks download their data)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hpctrain.data.tokenizer import TokenizerSpec, load
from hpctrain.dispatch import launch
from tests.conftest import make_config
from tests.integration.test_eval_task import trained  # noqa: F401 - the shared tiny run

pytest.importorskip("lm_eval")

TASK_YAML = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [{"question": "def f(x):\n    return", "choices": [" x", " 7y#", " ()"], "answer": 0},
        {"question": "import os\nimport", "choices": [" sys", " 9!!", " qq"], "answer": 0},
        {"question": "for i in", "choices": [" range(3):", " ]]]", " 12"], "answer": 0}]


@pytest.fixture(scope="module")
def lm(trained):  # noqa: F811 - the fixture imported above
    from hpctrain.checkpoint.one_device import load_one_device
    from hpctrain.tasks.eval.lm_eval_adapter import lm_class

    loaded = load_one_device(from_=str(trained[0]))
    return lm_class()(loaded.model, load(TokenizerSpec("byte")), max_length=64, batch_size=2)


class _Request:  # what the adapter reads of lm-eval's Instance
    def __init__(self, *args):
        self.args = args


def _direct(model, context: str, continuation: str) -> tuple[float, bool]:
    """Σ log p of the continuation's bytes after [eod] + context, one unbatched forward."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    ids = torch.tensor([[256, *ctx, *cont]])
    with torch.no_grad():
        logp = F.log_softmax(model(ids[:, :-1]).float(), -1)[0, len(ctx):]
    target = torch.tensor(cont)
    return logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


def test_loglikelihood_equals_the_models_own(lm):
    pairs = [(d["question"], c) for d in DOCS for c in d["choices"]] + [("", "abc")]
    got = lm.loglikelihood([_Request(*p) for p in pairs])  # batches of 2, right-padded
    for (context, continuation), (logp, greedy) in zip(pairs, got, strict=True):
        want, want_greedy = _direct(lm.model, context, continuation)
        assert logp == pytest.approx(want, rel=1e-5, abs=1e-5) and greedy == want_greedy


def test_is_greedy_is_true_for_the_models_own_continuation(lm):
    context = "import os"  # no trailing space: encode_pair would move it to the continuation
    text = lm.greedy(context, {"until": [], "max_gen_toks": 4})
    assert len(text.encode()) == 4
    assert lm.loglikelihood([_Request(context, text)])[0][1] is True
    changed = text[:-1] + chr((ord(text[-1]) + 1) % 128)
    assert lm.loglikelihood([_Request(context, changed)])[0][1] is False


def test_rolling_loglikelihood_covers_every_token_once(lm):
    text = "x = 1\n" * 30  # 180 bytes: three windows of 64
    got = lm.loglikelihood_rolling([_Request(text)])[0]
    ids = [256, *text.encode()]
    want = 0.0
    for start in range(1, len(ids), 64):  # predict tokens start..start+63 from a full window
        end = min(start + 64, len(ids))
        first = max(0, end - 65)
        with torch.no_grad():
            logp = F.log_softmax(lm.model(torch.tensor([ids[first:end - 1]])).float(), -1)[0]
        targets = torch.tensor(ids[first + 1:end])
        per = logp.gather(-1, targets[:, None])[:, 0]
        want += per[start - first - 1:].sum().item()
    assert got == pytest.approx(want, rel=1e-5)


def test_generate_until_stops_at_the_stop_string(lm):
    free = lm.greedy("def f(x):\n", {"until": [], "max_gen_toks": 12})
    stop = free[3:5]
    cut = lm.generate_until([_Request("def f(x):\n", {"until": [stop], "max_gen_toks": 12})])
    assert cut == [free[:free.index(stop)]]


def test_task_eval_runs_a_local_lm_eval_task_offline(trained, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_choice.yaml").write_text(TASK_YAML.format(data=data))
    result = launch(make_config(["task=eval", "logger=none", f"eval.from={trained[0]}",
                                 "eval.samples=0", "eval.lm_eval_tasks=[tiny_choice]",
                                 f"eval.lm_eval_include_path={tmp_path / 'tasks'}"],
                                run_dir=tmp_path / "out"))
    acc = result["lm_eval"]["results"]["tiny_choice"]["acc,none"]
    assert acc in (0.0, 1 / 3, 2 / 3, 1.0)
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["lm_eval"]["results"]["tiny_choice"]["acc,none"] == acc
    assert "eval_loss" not in saved  # eval.samples=0: lm-eval only


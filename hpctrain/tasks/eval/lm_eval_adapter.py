"""hpctrain's model behind lm-eval's model interface (lm-eval 0.4, the `eval` extra).

`HpctrainLM` scores text as lm-eval's own Hugging Face model (`HFLM`) does, on one device:

- loglikelihood(context, continuation) = Σ log p(c_i | prefix, context, c_<i) over the
  continuation's tokens c_i, with is_greedy = every c_i is the argmax at its position. The
  pair is tokenised as a whole (context + continuation, trailing spaces of the context moved
  to the continuation) and the continuation is the tokens after the context's, as HFLM does;
  the prefix is the tokenizer's bos (hpctrain frames documents [bos] text [eod]), else its eod
  (what precedes a document in the training stream); at most max_length tokens are read, the
  oldest dropped.
- loglikelihood_rolling(text): the sum over lm-eval's disjoint windows of max_length tokens
  (`lm_eval.utils.get_rolling_token_windows`, each token predicted once).
- generate_until(context, {until, max_gen_toks}): greedy decoding (the argmax each step, any
  sampling settings ignored) with the KV cache of task=generate (`generate.generate_ids`),
  until eod, a stop string (cut off the text) or max_gen_toks tokens; the context keeps its
  newest tokens so that it and the new ones fit max_length.

Requests are scored `batch_size` at a time, right-padded with eod: the model is causal, so
padding after a row's last token changes none of its logits.

The scoring lives in `Scorer` (no lm-eval import); `lm_class()` makes the `LM` subclass when
called, because importing lm-eval sets HF_XET_HIGH_PERFORMANCE in os.environ (its
__init__.py) and importing an hpctrain module changes nothing process-wide.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from hpctrain.config.eval import EvalConfig
from hpctrain.data.tokenizer import Encoder
from hpctrain.parallel.step import autocast
from hpctrain.tasks.generate.generate import generate_ids
from hpctrain.tasks.generate.sampling import Sampling

log = logging.getLogger(__name__)

Pair = tuple[list[int], list[int]]  # (context tokens with the prefix, continuation tokens)


class Scorer:
    """An eval-mode hpctrain model and its tokenizer: what lm-eval asks of a model (module
    doc), on the model's device."""

    def __init__(self, model: torch.nn.Module, encoder: Encoder, *, max_length: int,
                 precision: str = "fp32", batch_size: int = 8, max_gen_toks: int = 256):
        self.model, self.encoder = model, encoder
        self.max_length, self.precision = max_length, precision
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self._device = next(model.parameters()).device  # lm-eval's LM.device reads it
        self.prefix = encoder.bos_id if encoder.bos_id is not None else encoder.eod_id

    def tok_encode(self, text: str) -> list[int]:
        """The token ids of `text`, without hpctrain's [bos] … [eod] framing."""
        framed = self.encoder.frame(text).tolist()
        return framed[(self.encoder.bos_id is not None):-1]

    def encode_pair(self, context: str, continuation: str) -> Pair:
        """(prefix + context tokens, continuation tokens), as HFLM splits them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.tok_encode(context + continuation), self.tok_encode(context)
        return [self.prefix, *head], whole[len(head):]

    def rolling(self, text: str) -> float:
        """Σ log-prob of every token of `text` over lm-eval's disjoint windows (module doc)."""
        from lm_eval import utils as lm_utils

        windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.prefix,
            max_seq_len=self.max_length, context_len=1)]
        return sum(lp for lp, _ in self.score([(list(a), list(b)) for a, b in windows]))

    def score(self, pairs: list[Pair]) -> list[tuple[float, bool]]:
        """(Σ log-prob of the continuation, is_greedy) of each pair, `batch_size` at a time."""
        out: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), self.batch_size):
            out += self._score_batch(pairs[start:start + self.batch_size])
        return out

    @torch.no_grad()
    def _score_batch(self, pairs: list[Pair]) -> list[tuple[float, bool]]:
        rows = []
        for context, continuation in pairs:
            if not 0 < len(continuation) <= self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens: lm-eval scores "
                                 f"1 to {self.max_length} (model.max_seq_len) tokens at a time")
            rows.append((context + continuation)[-(self.max_length + 1):])
        width = max(len(r) - 1 for r in rows)
        inputs_BL = torch.full((len(rows), width), self.encoder.eod_id, dtype=torch.long)
        for i, row in enumerate(rows):
            inputs_BL[i, :len(row) - 1] = torch.tensor(row[:-1])
        logp_BLV = F.log_softmax(self.logits(inputs_BL).float(), dim=-1)
        out = []
        for i, (row, (_, continuation)) in enumerate(zip(rows, pairs, strict=True)):
            end = len(row) - 1
            logp_CV = logp_BLV[i, end - len(continuation):end]
            target_C = torch.tensor(continuation, device=logp_CV.device)
            total = logp_CV.gather(-1, target_C[:, None]).sum().item()
            out.append((float(total), bool((logp_CV.argmax(-1) == target_C).all())))
        return out

    def logits(self, inputs_BL: torch.Tensor) -> torch.Tensor:
        with autocast(self.precision, self._device):
            return self.model(inputs_BL.to(self._device))

    @torch.no_grad()
    def greedy(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        """The greedy continuation of `context` (module doc)."""
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        limit = min(int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
        ids = [self.prefix, *self.tok_encode(context)][-(self.max_length - limit):]
        with autocast(self.precision, self._device):
            done = generate_ids(self.model, ids, max_new_tokens=limit, sampling=Sampling(),
                                stop_id=self.encoder.eod_id,
                                stop=lambda new: any(u in self.encoder.decode(new)
                                                     for u in until))
        text = self.encoder.decode(done.ids)
        cuts = [text.index(u) for u in until if u in text]
        return text[:min(cuts)] if cuts else text


@functools.cache
def lm_class() -> type:
    """`HpctrainLM`: lm-eval's `LM` over a `Scorer` (imports lm-eval: module doc)."""
    from lm_eval.api.model import LM

    class HpctrainLM(Scorer, LM):
        """An hpctrain model as an lm-eval model (hpctrain.tasks.eval.lm_eval_adapter)."""

        def __init__(self, model: torch.nn.Module, encoder: Encoder, **kw: Any):
            LM.__init__(self)
            Scorer.__init__(self, model, encoder, **kw)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self.score([self.encode_pair(*r.args) for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return [self.rolling(r.args[0]) for r in requests]

        def generate_until(self, requests, disable_tqdm: bool = False):
            return [self.greedy(r.args[0], r.args[1] if len(r.args) > 1 else {})
                    for r in requests]

    return HpctrainLM


def run_lm_eval(lm, s: EvalConfig) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `lm` (an `lm_class()` instance) on eval.lm_eval_tasks
    (custom tasks from eval.lm_eval_include_path): its results, versions and shots."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = _task_manager(TaskManager, s)
    missing = [t for t in s.lm_eval_tasks if t not in manager.all_tasks]
    if missing:
        where = (f" nor in eval.lm_eval_include_path={s.lm_eval_include_path}"
                 if s.lm_eval_include_path else "")
        raise ValueError(f"eval.lm_eval_tasks: {missing} are not lm-eval tasks{where}: "
                         "`lm-eval ls tasks` lists them (or add a task YAML to "
                         "eval.lm_eval_include_path)")
    out = simple_evaluate(model=lm, tasks=list(s.lm_eval_tasks), task_manager=manager,
                          limit=s.limit, num_fewshot=s.num_fewshot, log_samples=False)
    return {k: out.get(k) for k in ("results", "versions", "n-shot")}


def _task_manager(task_manager: type, s: EvalConfig):
    """lm-eval's task index: eval.lm_eval_include_path's tasks alone when they are all that is
    named (indexing lm-eval's own ~14,000 task files takes ~10 s), else with lm-eval's."""
    if s.lm_eval_include_path is not None:
        own = task_manager(include_path=s.lm_eval_include_path, include_defaults=False)
        if all(t in own.all_tasks for t in s.lm_eval_tasks):
            return own
    return task_manager(include_path=s.lm_eval_include_path)

"""The synthetic batches and single-process references every parallel test compares with.

Batches: random tokens from a seeded generator, as (inputs, targets) shifted by one; the same
seed and shape give the same tokens on every rank, so each rank can cut its own share.

References are plain torch, no hpctrain engine:
- `fp64_grads`: one forward/backward of each micro-batch (loss / n_micro) → mean loss and full
  gradients by name (`grad_norm` of them); `fp64_packed_grads` the same over packed
  documents, all micro-batches as one batch (one mean over their real tokens);
- `reference_step`: that, then torch's clip_grad_norm_ and torch AdamW (matrices decayed, norm
  gains not; foreach=False), zero_grad; `reference_run` repeats it over steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from hpctrain.config.schema import OptimConfig
from hpctrain.models import build_model
from hpctrain.ops.documents import IGNORE_INDEX, Documents
from hpctrain.parallel.step import lm_loss
from hpctrain.train.optim import param_groups

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs_BL, targets_BL)


def token_batch(rows: int, seq: int, *, vocab: int, seed: int) -> Batch:
    """`rows` random sequences of `seq` + 1 tokens, as (inputs, targets)."""
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def micro_batches(m: int, rows: int, seq: int, *, vocab: int, seed: int) -> list[Batch]:
    """`m` micro-batches of `rows` × `seq` tokens, drawn at once from one seeded generator."""
    seqs = torch.randint(0, vocab, (m, rows, seq + 1),
                         generator=torch.Generator().manual_seed(seed))
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def packed_micro_batches(n: int, rows: int, seq: int, *, vocab: int, seed: int
                         ) -> list[tuple[torch.Tensor, torch.Tensor, Documents]]:
    """n micro-batches of `rows` rows, each row several documents (one of length 1) and
    padding at its end: 0..seq-1 tokens in row 0, 0..seq/2 in the others, so real tokens per
    micro-batch vary widely (every one keeps at least one)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        ids = torch.empty(rows, seq, dtype=torch.long)
        for b in range(rows):
            cuts = sorted(torch.randperm(seq - 2, generator=gen)[:3].add(1).tolist())
            ids[b] = torch.bucketize(torch.arange(seq), torch.tensor(cuts), right=True)
        for b in range(rows):
            most = seq - 1 if b == 0 else seq // 2
            pad = int(torch.randint(0, most + 1, (), generator=gen))
            targets[b, seq - pad:] = IGNORE_INDEX
            ids[b, seq - pad:] = ids[b, seq - pad - 1] + 1
        out.append((inputs, targets, Documents.from_ids(ids)))
    return out


def ce64(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in the logits' dtype (lm_loss casts to fp32; fp64 references keep fp64)."""
    return F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL.flatten())


def fp64_grads(cfg, micro: Sequence[Batch], *, seed: int, loss_fn: Callable = ce64
               ) -> tuple[float, dict[str, torch.Tensor]]:
    """(mean loss, full gradients by name) of the fp64 model built from `cfg` and `seed`."""
    model = build_model(cfg, seed=seed).double()
    loss_sum = 0.0
    for inputs, targets in micro:
        loss = loss_fn(model(inputs), targets) / len(micro)
        loss.backward()
        loss_sum += float(loss)
    return loss_sum, {n: p.grad for n, p in model.named_parameters()}


def fp64_packed_grads(cfg, micro, *, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients by name) of one fp64 process over packed micro-batches at once: them
    concatenated, one mean over all their real tokens."""
    model = build_model(cfg, seed=seed).double()
    inputs, targets, docs = zip(*micro, strict=True)
    docs = Documents(ids_BL=torch.cat([d.ids_BL for d in docs]),
                     positions_BL=torch.cat([d.positions_BL for d in docs]))
    loss = ce64(model(torch.cat(inputs), docs=docs), torch.cat(targets))
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def grad_norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))


def reference_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    groups = param_groups(list(model.named_parameters()), optim.weight_decay)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                             eps=optim.eps, foreach=False)


def reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, micro: Sequence[Batch],
                   *, n_micro: int, grad_clip: float, loss_fn=lm_loss) -> tuple[float, float]:
    """(mean loss over the micro-batches, grad norm before clipping)."""
    loss_sum = 0.0
    for inputs_BL, targets_BL in micro:
        loss = loss_fn(model(inputs_BL), targets_BL) / n_micro
        loss.backward()
        loss_sum += float(loss.detach())
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"),
                                          foreach=False)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss_sum, float(norm)


def reference_run(model: torch.nn.Module, optim: OptimConfig, steps: int,
                  batches: Callable[[int], list[Batch]], *, grad_clip: float,
                  loss_fn=lm_loss) -> tuple[dict[str, torch.Tensor], list[float]]:
    """`steps` reference steps on `batches(step)`: (final parameters by name, grad norms)."""
    opt = reference_optimizer(model, optim)
    norms = []
    for step in range(steps):
        micro = batches(step)
        norms.append(reference_step(model, opt, micro, n_micro=len(micro), grad_clip=grad_clip,
                                    loss_fn=loss_fn)[1])
    return {k: p.detach().clone() for k, p in model.named_parameters()}, norms

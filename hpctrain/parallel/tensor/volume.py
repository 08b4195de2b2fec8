"""Analytical tp communication volume: bytes each rank sends per micro-batch (fwd + bwd).

With p = tp, b micro-batch, s sequence, h model dim, e bytes per activation element and
ring collectives (an all-reduce of n bytes sends 2(p−1)/p·n; an all-gather or reduce-scatter
of n total bytes sends (p−1)/p·n):
  - each block: 4 all-reduces of b·s·h (f and g for attention and MLP, fwd + bwd), or with sp
    4 all-gathers + 4 reduce-scatters of b·s·h — the same bytes;
  - the embedding (g, or a reduce-scatter fwd + all-gather bwd) and the output head's entry
    (f, or an all-gather fwd + reduce-scatter bwd): 2 more all-reduce equivalents of b·s·h;
  - the vocab-parallel loss: all-reduces of b·s maxima and 2·b·s (sum-exp, target logit)
    in the loss dtype (e_loss bytes).
Gradient syncs of replicated parameters (sync_tp_grads) are not activations and not counted.
"""

from __future__ import annotations


def tp_activation_bytes(*, tp: int, n_layers: int, batch: int, seq: int, dim: int,
                        elem_bytes: int, loss_elem_bytes: int = 4) -> int:
    """Bytes this rank sends on the tp axis for one micro-batch, forward and backward."""
    if tp == 1:
        return 0
    act = batch * seq * dim * elem_bytes
    per_all_reduce = 2 * (tp - 1) * act // tp
    loss = 2 * (tp - 1) * (3 * batch * seq * loss_elem_bytes) // tp
    return (4 * n_layers + 2) * per_all_reduce + loss

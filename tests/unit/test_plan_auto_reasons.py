"""parallel=auto's reasons a layout lost read as sentences a person can act on."""

from __future__ import annotations

from types import SimpleNamespace as NS

from hpctrain.plan.auto import _lost


def _cand(*, step=1.0, zero=0, recompute="none", mem=1.0, bubble=0.0, dp=0.0, exact=True):
    return NS(time=NS(step_time_s=step, bubble_fraction=bubble, comm_dp_s=dp),
              layout=NS(zero=zero), recompute=recompute, memory=NS(total=mem), exact=exact)


def test_reasons_are_sentences():
    best = _cand()
    assert _lost(_cand(zero=1), best) == (
        "It is as fast as the chosen layout (1.000× its step time), but shards with ZeRO stage "
        "1 where stage 0 is as fast; on a tie the lower stage wins (fewer collectives per "
        "step).")
    assert "recomputes activations (full) where none is as fast" in _lost(
        _cand(recompute="full"), best)
    slow = _lost(_cand(step=1.5, bubble=0.3, dp=0.5), best)
    assert slow == ("It is 1.50× slower per step than the chosen layout: its pipeline bubble "
                    "is 30% of the step and data-parallel communication takes 33% of it.")
    assert _lost(_cand(step=2.0, exact=False), best).endswith("so it was not simulated.")
    assert all(s.endswith(".") for s in (_lost(_cand(mem=2.0), best), slow))

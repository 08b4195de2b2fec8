"""Checks of the context-parallel axis (`parallel.cp`), each naming the fix.

The zigzag layout (hpctrain.parallel.context.shard) cuts every row into 2·cp equal chunks, so
the sequence length must divide by 2·cp. Activation checkpointing composes with cp (full
reruns the ring in backward, selective leaves ring attention alone: models/checkpointing.py),
and so does train.compile (dynamo breaks the graph at the ring's exchanges: models/compile.py).
Each backend's own kernels run the ring's blocks (parallel/context/backends.py), never the eager
math behind the user's back; flash's block needs a flash-attn whose private entry points
hpctrain knows (checked here).
"""

from __future__ import annotations

from hpctrain.config import Config
from hpctrain.parallel.context.flash_block import version_problem


def check_cp(c: Config) -> list[str]:
    p, L = c.parallel, c.train.seq_len
    if p.cp <= 1:  # below 1: the range check reports it
        return []
    errs = []
    if L % (2 * p.cp):
        ok = [1, *(n for n in (2, 4, 8, 16, 32) if L % (2 * n) == 0)]  # cp=1: no chunks
        below, above = L - L % (2 * p.cp), L + 2 * p.cp - L % (2 * p.cp)
        near = f"{below} or {above}" if below >= 2 * p.cp else str(above)
        errs.append(f"train.seq_len={L} is not divisible by 2 × parallel.cp={p.cp} = {2 * p.cp}"
                    f" (the zigzag layout cuts each row into 2·cp chunks): choose a seq_len "
                    f"that is a multiple of {2 * p.cp} (e.g. {near}), or parallel.cp in {ok}")
    if c.model.attention == "flash" and (problem := version_problem()):
        errs.append(problem)
    return errs

"""Pipeline actions and schedules as plain data.

An `Action(stage, kind, microbatch)` is one unit of work on one pipeline stage: a forward (F), the
gradient w.r.t. the stage input (B), the gradient w.r.t. the stage weights (W), or both backward
halves fused (BW, used by schedules that do not split the backward). Lowering adds point-to-point
communication kinds. A `Schedule` is, per rank, the tuple of actions it executes in order, plus the
stage→rank map. Stage 0 holds the embedding, stage n_stages-1 the loss.

Compact text form: f"{stage}{kind}{microbatch}", e.g. `2F5`, `0BW3`, `1SEND_F4`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class ActionKind(Enum):
    F = "F"  # forward
    B = "B"  # gradient w.r.t. the stage input (on the critical path)
    W = "W"  # gradient w.r.t. the stage weights (deferrable)
    BW = "BW"  # B then W, fused
    SEND_F = "SEND_F"  # send stage output activations to stage+1
    RECV_F = "RECV_F"  # receive stage input activations from stage-1
    SEND_B = "SEND_B"  # send the input gradient to stage-1
    RECV_B = "RECV_B"  # receive the output gradient from stage+1

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW})
_COMPACT = re.compile(r"^(\d+)([A-Z_]+)(\d+)$")


@dataclass(frozen=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of `str`: '2F5' → Action(2, F, 5)."""
        match = _COMPACT.match(text.strip())
        if match is None or match.group(2) not in ActionKind._value2member_map_:
            kinds = ", ".join(k.value for k in ActionKind)
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> such as "
                f"'2F5' with kind one of {kinds}"
            )
        stage, kind, mb = match.groups()
        return cls(int(stage), ActionKind(kind), int(mb))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists in execution order plus the stage→rank placement.

    `n_stages = n_ranks * chunks`; `stage_to_rank[s]` is the rank that runs stage s.
    """

    name: str
    n_ranks: int
    n_stages: int
    n_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if len(self.stage_to_rank) != self.n_stages:
            raise ValueError(
                f"schedule {self.name!r}: stage_to_rank has {len(self.stage_to_rank)} entries "
                f"but n_stages={self.n_stages}: give one rank per stage"
            )
        if len(self.actions) != self.n_ranks:
            raise ValueError(
                f"schedule {self.name!r}: {len(self.actions)} action lists for "
                f"n_ranks={self.n_ranks}: give one list per rank"
            )
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.n_ranks]
        if bad:
            raise ValueError(
                f"schedule {self.name!r}: stage_to_rank names ranks {bad} outside "
                f"0..{self.n_ranks - 1}"
            )

    @property
    def chunks(self) -> int:
        """Stages (model chunks) per rank."""
        return self.n_stages // self.n_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def to_csv(self) -> str:
        """Header line `# key=value;...`, then one row per rank: `rank,action,action,...`."""
        placement = " ".join(str(r) for r in self.stage_to_rank)
        header = (
            f"# name={self.name};n_ranks={self.n_ranks};n_stages={self.n_stages};"
            f"n_microbatches={self.n_microbatches};stage_to_rank={placement}"
        )
        rows = [",".join([str(r), *map(str, acts)]) for r, acts in enumerate(self.actions)]
        return "\n".join([header, *rows]) + "\n"

    @classmethod
    def from_csv(cls, text: str) -> Schedule:
        """Inverse of `to_csv`."""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines or not lines[0].startswith("#"):
            raise ValueError("schedule CSV must start with a '# name=...;n_ranks=...' header line")
        meta = dict(kv.split("=", 1) for kv in lines[0][1:].strip().split(";"))
        n_ranks = int(meta["n_ranks"])
        per_rank: list[tuple[Action, ...]] = [() for _ in range(n_ranks)]
        for line in lines[1:]:
            rank, *cells = line.split(",")
            per_rank[int(rank)] = tuple(Action.parse(c) for c in cells if c.strip())
        return cls(
            name=meta["name"],
            n_ranks=n_ranks,
            n_stages=int(meta["n_stages"]),
            n_microbatches=int(meta["n_microbatches"]),
            stage_to_rank=tuple(int(r) for r in meta["stage_to_rank"].split()),
            actions=tuple(per_rank),
        )

"""A rule of the configuration: a function of the Config that returns its problems, declared
with the keys it reads (hpctrain.config.validate runs them)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

from hpctrain.config.schema import Config

Stage = Literal["input", "derived"]


class Check:
    """One rule (module docstring): call it with a Config for its problems."""

    def __init__(self, fn: Callable[[Config], list[str]], reads: tuple[str, ...], *,
                 stage: Stage, data: bool):
        if not reads:
            raise TypeError(f"{fn.__name__}: a check names the keys it reads")
        self.fn, self.reads, self.stage, self.data = fn, reads, stage, data
        functools.update_wrapper(self, fn)

    def __call__(self, c: Config) -> list[str]:
        return self.fn(c)

    def __repr__(self) -> str:
        return f"<check {self.fn.__name__}: {', '.join(self.reads)}>"

    @property
    def key(self) -> str:
        """The key its problems are reported under."""
        return self.reads[0]


def check(*reads: str, stage: Stage = "derived",
          data: bool = False) -> Callable[[Callable[[Config], list[str]]], Check]:
    """Declare a rule and the keys it reads (module docstring)."""
    return lambda fn: Check(fn, reads, stage=stage, data=data)


def errors_of(c: Config, *builders: Callable[[Config], object]) -> list[str]:
    """The messages of the ValueErrors that `builders` raise on `c` (a builder that accepts
    its input is a check of it)."""
    errs = []
    for build in builders:
        try:
            build(c)
        except ValueError as err:
            errs.append(str(err))
    return errs

"""`Slice`: positions start, start+step, ... < stop of a stream (`.take(n)`, `.skip(n)`).

Terms (docs/glossary.md): position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zephon.errors import PlanError
from zephon.plan.node import Node, check_int
from zephon.plan.refs import Refs

__all__ = ["Slice", "skip", "take"]


@dataclass(frozen=True)
class Slice(Node, kind="Slice"):
    """Positions start, start+step, ... < stop of the child (`take(n)` and `skip(n)` are special cases)."""

    child: Node
    start: int = 0
    stop: int | None = None
    step: int = 1

    def __post_init__(self) -> None:
        check_int("Slice.start", self.start, 0)
        check_int("Slice.step", self.step, 1)
        if self.stop is not None:
            check_int("Slice.stop", self.stop, self.start)
        if self.length == 0:
            raise PlanError(f"Slice({self.start}, {self.stop}) of a stream of {self.child.length} "
                            "positions is empty; widen the slice.")

    @property
    def length(self) -> int | None:
        stop = self.child.length if self.stop is None else (
            self.stop if self.child.length is None else min(self.stop, self.child.length))
        if stop is None:
            return None
        return max(0, -(-(stop - self.start) // self.step))

    @property
    def period(self) -> int | None:
        p = self.child.period
        if self.stop is None and self.step == 1 and p is not None and self.start % p == 0:
            return p
        return None

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        return self.child._resolve(self.start + pos * self.step, epoch)


def take(child: Node, n: int) -> Slice:
    """The first `n` positions of `child` (`child.take(n)`)."""
    return Slice(child, 0, n)


def skip(child: Node, n: int) -> Slice:
    """`child` without its first `n` positions (`child.skip(n)`)."""
    return Slice(child, n, None)

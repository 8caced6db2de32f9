"""`Shuffle`: a keyed Feistel bijection per epoch (`zephon.plan.permute`), exactly once per epoch.

Terms (docs/glossary.md): position, epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zephon.errors import PlanError
from zephon.plan.node import Node, PassThrough, check_int
from zephon.plan.permute import permute
from zephon.plan.refs import Refs

__all__ = ["Shuffle"]


@dataclass(frozen=True)
class Shuffle(PassThrough, kind="Shuffle"):
    """A keyed bijection per epoch.

    Over a repeated stream (a child with a `period`) it permutes within each epoch, so every
    record still appears once per epoch; otherwise it permutes the whole (finite) child.
    """

    child: Node
    seed: int

    def __post_init__(self) -> None:
        check_int("Shuffle.seed", self.seed, 0)
        if self.child.length is None and self.child.period is None:
            raise PlanError("cannot shuffle an infinite stream that has no epoch length (e.g. a mix "
                            "of repeated sources); shuffle each child before repeat/mix, or mix "
                            "finite sources and then repeat and shuffle.")

    @property
    def _block(self) -> int:
        p = self.child.period
        return p if p is not None else self.child.length  # type: ignore[return-value]

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        n = self._block
        block, inner = np.divmod(pos, n)
        # Key by (outer epoch + block): Repeat(Shuffle(x)) and Shuffle(Repeat(x)) are the same stream.
        shuffled = permute(inner, n, self.seed, epoch + block)
        return self.child._resolve(block * n + shuffled, epoch)

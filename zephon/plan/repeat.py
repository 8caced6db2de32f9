"""`Repeat`: passes over a finite stream, each pass a new epoch (shuffles below it re-keyed).

Terms (docs/glossary.md): epoch, position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zephon.errors import PlanError
from zephon.plan.node import Node, check_int
from zephon.plan.refs import Refs

__all__ = ["Repeat"]

#: Epochs of an outer pass around a forever-repeat never collide with the inner ones.
FOREVER_EPOCH_STRIDE = 1 << 32


@dataclass(frozen=True)
class Repeat(Node, kind="Repeat"):
    """`count` passes over a finite child (None: forever); each pass is a new epoch."""

    child: Node
    count: int | None = None

    def __post_init__(self) -> None:
        if self.count is not None:
            check_int("Repeat.count", self.count, 1)
        if self.child.length is None:
            raise PlanError("cannot repeat an infinite stream; repeat before mixing or take() a "
                            "finite prefix first.")

    @property
    def length(self) -> int | None:
        return None if self.count is None else self.child.length * self.count  # type: ignore[operator]

    @property
    def period(self) -> int:
        return self.child.length  # type: ignore[return-value]

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        e, inner = np.divmod(pos, self.period)
        stride = self.count if self.count is not None else FOREVER_EPOCH_STRIDE
        return self.child._resolve(inner, epoch * stride + e)

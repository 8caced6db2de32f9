"""`Source`: the leaf of every plan, positions 0..size-1 of one record source.

Terms (docs/glossary.md): source, record, position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zephon.errors import PlanError
from zephon.plan.node import Node, check_int
from zephon.plan.refs import Refs

__all__ = ["Source"]


@dataclass(frozen=True)
class Source(Node, kind="Source"):
    """Positions 0..size-1 of record source `id` (the loader maps ids to record sources)."""

    size: int
    id: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.size, (int, np.integer)) and not isinstance(self.size, bool) and self.size == 0:
            raise PlanError(f"Source {self.name or self.id} is empty (size 0); a plan needs at least "
                            "one record per source — check the file/split you pointed it at.")
        check_int("Source.size", self.size, 1)
        check_int("Source.id", self.id, 0)

    @property
    def length(self) -> int:
        return int(self.size)

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        return Refs(np.full(pos.shape, self.id, np.int64), pos, epoch)

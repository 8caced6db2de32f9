"""`Refs`: record references, the output of every plan node (which source, record, epoch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

__all__ = ["Refs"]


@dataclass(frozen=True)
class Refs:
    """Record references, one per position: which source, which record, which epoch.

    `extra` holds optional further int64 columns, one value per position, that a node adds while
    resolving (e.g. Grain's element index at some depth of a pipeline, `grain_index/<tag>`).
    They ride along through every node, filter (`take`) and merge (`concat`, mixes); a row that
    comes from a part without a column gets `EXTRA_FILL`.
    """

    source: np.ndarray
    record: np.ndarray
    epoch: np.ndarray
    extra: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    EXTRA_FILL: ClassVar[int] = -1

    def __len__(self) -> int:
        return len(self.record)

    def take(self, idx: np.ndarray | slice) -> Refs:
        return Refs(self.source[idx], self.record[idx], self.epoch[idx],
                    {k: v[idx] for k, v in self.extra.items()})

    def with_extra(self, name: str, values: np.ndarray) -> Refs:
        """These references with column `name` added (or replaced)."""
        return Refs(self.source, self.record, self.epoch, {**self.extra, name: values})

    @staticmethod
    def concat(parts: Sequence[Refs]) -> Refs:
        names = sorted({k for p in parts for k in p.extra})
        extra = {k: np.concatenate([p.extra[k] if k in p.extra else
                                    np.full(len(p), Refs.EXTRA_FILL, np.int64) for p in parts])
                 for k in names}
        source, record, epoch = (np.concatenate([getattr(p, f) for p in parts])
                                 for f in ("source", "record", "epoch"))
        return Refs(source, record, epoch, extra)

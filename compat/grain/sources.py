"""Grain data sources as Zephon record sources.

A Grain random-access source (anything with `__len__` and `__getitem__`) becomes a
`GrainSource` whose reads hand its records over unchanged in the `RECORD` column; a columnar
Zephon source mixed with Grain sources is wrapped in `RecordsOf`, so every child of a mix hands
its transforms records of one kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon.errors import DecodeError, PlanError
from zephon.sources.base import Columns, RecordSource, as_indices

from .records import record_column, records_of


class GrainSource:
    """A Grain random-access data source as a Zephon `RecordSource`.

    Anything with `__len__` and `__getitem__` works (`grain.sources.ArrayRecordDataSource`,
    `RangeDataSource`, `SharedMemoryDataSource` alias `grain.python.InMemoryDataSource`, your own
    class, a list, an array); `__getitems__` is used when
    present so ArrayRecord reads a whole batch in one parallel call. Records are returned as-is
    in the `RECORD` object column (see `records`).
    """

    def __init__(self, source: Any) -> None:
        if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
            raise PlanError(f"{type(source).__name__} is not a random-access data source; it needs "
                            "__len__ and __getitem__ (e.g. grain.sources.ArrayRecordDataSource).")
        self.source = source
        self._len = len(source)
        self._what = f"GrainSource({type(source).__name__})"
        self._getitems = getattr(source, "__getitems__", None)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"GrainSource({self.source!r})"

    def read(self, indices: np.ndarray) -> Columns:
        keys = as_indices(indices, self._len, self._what).tolist()
        recs = self._getitems(keys) if self._getitems is not None else [self.source[k] for k in keys]
        if len(recs) != len(keys):
            raise DecodeError(f"{self._what}.__getitems__ returned {len(recs)} records for "
                              f"{len(keys)} keys; it must return one record per key.")
        return record_column(recs)


class RecordsOf:
    """A columnar Zephon source whose rows are handed out as dict records (for mixing)."""

    def __init__(self, source: RecordSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"RecordsOf({self.source!r})"

    def read(self, indices: np.ndarray) -> Columns:
        return record_column(records_of(self.source.read(indices)))


def is_zephon_source(src: Any) -> bool:
    return callable(getattr(src, "read", None)) and hasattr(src, "__len__") and not hasattr(
        src, "__getitem__")

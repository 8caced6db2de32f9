"""Filter and FlatMap: row operators that change how many records a lane's inputs give.

A lane then needs a cursor (how far into its inputs it has read) instead of `step × rows`; the
engine keeps one per lane, and still runs these operators in parallel over read-ahead windows
because their carry is empty.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.ops.base import Transform, call_on_record, output_of
from zephon.plan import Refs
from zephon.sources.base import Columns
from zephon.sources.columns import to_columns, to_records


@dataclass(frozen=True)
class Filter(Transform):
    """Keeps records where fn(record) is true (batched=True: fn(columns) -> bool mask)."""

    fn: Callable[..., Any]
    batched: bool = False
    name: str | None = None
    version: int = 1
    params: Mapping[str, Any] = field(default_factory=dict)
    one_to_one = False

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray]:
        if self.batched:
            keep = np.asarray(self.fn(cols), dtype=bool)
        else:
            keep = np.fromiter((bool(call_on_record(self.fn, self.op_name, refs, i, r))
                                for i, r in enumerate(to_records(cols))), dtype=bool, count=len(refs))
        if keep.shape != (len(refs),):
            raise PlanError(f"{self.op_name} returned a mask of shape {keep.shape}, expected ({len(refs)},)")
        return {k: v[keep] for k, v in cols.items()}, keep


@dataclass(frozen=True)
class FlatMap(Transform):
    """fn(record) -> list of records (zero, one or many), in order.

    A lane's position then names the record and how many of its outputs were used, so a stop
    in the middle of one record's outputs resumes exactly there.
    """

    fn: Callable[..., Any]
    name: str | None = None
    version: int = 1
    params: Mapping[str, Any] = field(default_factory=dict)
    one_to_one = False
    expands = True

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray]:
        outs: list[dict[str, Any]] = []
        rows: list[int] = []
        for i, r in enumerate(to_records(cols)):
            got = call_on_record(self.fn, self.op_name, refs, i, r)
            if not isinstance(got, (list, tuple)):
                raise PlanError(f"{self.op_name} must return a list of records, got "
                                f"{type(got).__name__} for record {int(refs.record[i])} of source "
                                f"{int(refs.source[i])}")
            outs += got
            rows += [i] * len(got)
        return to_columns(outs, output_of(self.op_name, refs, rows), template=cols), np.asarray(rows, np.int64)

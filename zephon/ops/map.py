"""Map and RandomMap: one output per input, so they keep a plan's O(1) random access.

A `RandomMap` draws from a generator seeded by (loader seed, its position in the pipeline, source,
record, epoch) — never by a worker, a rank or a call counter — so its output is a function of the
record alone, whichever thread or process runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zephon.ops.base import Transform, call_on_record, output_of, record_rng, record_seeds
from zephon.plan import Refs
from zephon.sources.base import Columns
from zephon.sources.columns import to_columns, to_records


@dataclass(frozen=True)
class Map(Transform):
    """fn(record) -> record, or with batched=True fn(columns) -> columns (vectorised).

    name/version/params declare the identity a checkpoint records (default: the function's
    module-qualified name, version 1, no params); bump `version` when `fn` changes behaviour.
    """

    fn: Callable[..., Any]
    batched: bool = False
    name: str | None = None
    version: int = 1
    params: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        if self.batched:
            return self.fn(cols), None
        recs = [call_on_record(self.fn, self.op_name, refs, i, r) for i, r in enumerate(to_records(cols))]
        return to_columns(recs, output_of(self.op_name, refs), template=cols), None


@dataclass(frozen=True)
class RandomMap(Transform):
    """fn(record, rng) -> record with rng derived from the record's identity (see module doc)."""

    fn: Callable[..., Any]
    name: str | None = None
    version: int = 1
    params: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        seeds = record_seeds(seed, refs)
        recs = [call_on_record(self.fn, self.op_name, refs, i, r, record_rng(seeds[i]))
                for i, r in enumerate(to_records(cols))]
        return to_columns(recs, output_of(self.op_name, refs), template=cols), None



"""Per-record and batched transforms, applied inside each lane.

Transforms see columns (dict of arrays) plus the record references of the rows, never a worker id
or a call counter: a `RandomMap` draws from a generator seeded by (loader seed, source, record,
epoch), so its output is a function of the record alone, whichever process or thread runs it.
A `Filter` changes how many inputs make an output; the loader then keeps a per-lane cursor so the
output stream of every lane still depends on nothing but that lane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from zephon.errors import DecodeError
from zephon.permute import splitmix64
from zephon.plan import Refs
from zephon.sources.base import Columns
from zephon.sources.spec import stack_values

Record = dict[str, Any]


def to_records(cols: Columns) -> list[Record]:
    n = len(next(iter(cols.values()))) if cols else 0
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def stack_records(records: list[Record], template: Columns | None = None) -> Columns:
    """Stacks per-record dicts into columns with the sources' rule (`stack_values`): numbers and
    equal-shape numeric arrays stack, anything else (text, bytes, ragged) is an object array, so a
    column's dtype never depends on which records one step happened to hold."""
    if not records:
        return {k: v[:0] for k, v in (template or {}).items()}
    return {k: stack_values([r[k] for r in records]) for k in records[0]}


def record_seeds(seed: int, refs: Refs) -> np.ndarray:
    """64-bit seeds derived from (seed, source, record, epoch) only."""
    h = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
    with np.errstate(over="ignore"):
        for part in (refs.source, refs.record, refs.epoch):
            h = splitmix64(h ^ part.astype(np.uint64))
    return np.broadcast_to(h, refs.record.shape)


def transform_seed(seed: int, position: int) -> int:
    """The seed of the transform at `position` in a pipeline seeded with `seed`."""
    mixed = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ splitmix64(np.uint64(position)))
    return int(mixed) & 0x7FFFFFFFFFFFFFFF


def record_rng(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=int(seed)))


class Transform:
    """Base class. `apply` returns the new columns and, for filters, a keep mask."""

    one_to_one: bool = True

    @property
    def name(self) -> str:
        fn = getattr(self, "fn", None)
        return f"{type(self).__name__}({getattr(fn, '__qualname__', type(fn).__name__)})"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray | None]:
        raise NotImplementedError


def _call(fn: Callable[..., Any], what: str, refs: Refs, i: int, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - re-raised with the record named
        raise DecodeError(f"{what} failed on record {int(refs.record[i])} of source "
                          f"{int(refs.source[i])} (epoch {int(refs.epoch[i])}): {e!r}. Fix the "
                          "transform or the record; nothing was skipped.") from e


@dataclass(frozen=True)
class Map(Transform):
    """fn(record) -> record, or with batched=True fn(columns) -> columns (vectorised)."""

    fn: Callable[..., Any]
    batched: bool = False

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        if self.batched:
            return self.fn(cols), None
        recs = [_call(self.fn, self.name, refs, i, r) for i, r in enumerate(to_records(cols))]
        return stack_records(recs, cols), None


@dataclass(frozen=True)
class RandomMap(Transform):
    """fn(record, rng) -> record with rng derived from the record's identity (see module doc)."""

    fn: Callable[..., Any]

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        seeds = record_seeds(seed, refs)
        recs = [_call(self.fn, self.name, refs, i, r, record_rng(seeds[i]))
                for i, r in enumerate(to_records(cols))]
        return stack_records(recs, cols), None


@dataclass(frozen=True)
class Filter(Transform):
    """Keeps records where fn(record) is true (batched=True: fn(columns) -> bool mask)."""

    fn: Callable[..., Any]
    batched: bool = False
    one_to_one = False

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray]:
        if self.batched:
            keep = np.asarray(self.fn(cols), dtype=bool)
        else:
            keep = np.fromiter((bool(_call(self.fn, self.name, refs, i, r))
                                for i, r in enumerate(to_records(cols))), dtype=bool,
                               count=len(refs))
        if keep.shape != (len(refs),):
            raise ValueError(f"{self.name} returned a mask of shape {keep.shape}, expected ({len(refs)},)")
        return cols, keep


def run_transforms(transforms: tuple[Transform, ...], cols: Columns, refs: Refs,
                   seed: int) -> tuple[Columns, np.ndarray]:
    """Applies transforms in order; returns surviving columns and the indices of surviving rows.

    Each transform gets its own seed, derived from (seed, its position in the pipeline), so two
    RandomMaps in one pipeline draw independent numbers for the same record.
    """
    kept = np.arange(len(refs))
    for i, t in enumerate(transforms):
        cols, keep = t.apply(cols, refs, transform_seed(seed, i))
        if keep is not None and not keep.all():
            cols = {k: v[keep] for k, v in cols.items()}
            refs = refs.take(keep)
            kept = kept[keep]
    return cols, kept

"""Grain records in Zephon columns: the `RECORD` column, and Grain's names for the one rule.

A Grain source returns Python objects; they travel as one object column (`RECORD`) through the
Grain transforms, which therefore see exactly what Grain would hand them, and are stacked into
columns once at the end by `zephon.sources.columns` with `tree=True` (Grain's records are pytrees: dict
keys nested with '/', tuple positions, a bare value is `VALUE`). The public names Grain users
met first (`flatten_record`, `stack_leaves`, `records_to_columns`, `unflatten_columns`) are that
rule under Grain's vocabulary; what is Grain's own lives here: `records_of` (what a Grain
transform receives), `collate` and `grain_batch_columns` (a batch real Grain produced).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.sources.base import Columns
from zephon.sources.columns import VALUE, flatten, objects, stack, to_columns, to_records, unflatten

RECORD = "__record__"
"""Column holding whole Grain records (Python objects) between source and final stacking."""
RNG = "__rng__"
"""Column of per-record generators that `grain.DataLoader` shares between its RandomMaps."""

stack_leaves = stack
"""One column from one leaf per record, as Grain's `np.stack` batches it (`zephon.sources.columns.stack`)."""
unflatten_columns = unflatten
"""Columns back to Grain's batch structure: dicts, tuples (digit keys 0..n-1) or a bare array."""


def flatten_record(record: Any) -> dict[str, Any]:
    """{field name: leaf} of one Grain record (dicts nest with '/', tuples by position)."""
    return flatten(record, tree=True)


def records_to_columns(records: Sequence[Any]) -> Columns:
    """Stacks Grain records into named columns; every record must have the same fields."""
    return to_columns(records, tree=True)


def records_of(cols: Columns) -> list[Any]:
    """The records a Grain transform receives: the raw objects, or dict rows of a columnar source."""
    return list(cols[RECORD]) if RECORD in cols else to_records(cols)


def record_column(records: Sequence[Any]) -> Columns:
    """Grain records as the one `RECORD` column."""
    return {RECORD: objects(records)}


def collate(cols: Columns) -> Columns:
    """Grain records of a step -> named columns (no-op for columnar data); drops `RNG`."""
    if RECORD in cols:
        return records_to_columns(list(cols[RECORD]))
    return {k: v for k, v in cols.items() if k != RNG}


def grain_strings(column: np.ndarray) -> np.ndarray:
    """A str (bytes) object column as Grain's `np.stack` gives it: a U (S) array as wide as its
    widest value here (Zephon's columns keep objects: their dtype never depends on the rows)."""
    if column.dtype != object or not column.size:
        return column
    values = column.tolist()
    flat = column.ravel().tolist()
    if all(isinstance(x, str) for x in flat) or all(isinstance(x, bytes) for x in flat):
        return np.array(values)
    return column


def elements(cols: Columns) -> list[Any]:
    """Unbatched output: Grain records (generators of a DataLoader's RandomMaps left behind)."""
    return records_of({k: v for k, v in cols.items() if k != RNG})


def grain_batch_columns(batch: Any) -> Columns:
    """A batch produced by real Grain as Zephon columns (S/U arrays become exact object arrays)."""
    out: Columns = {}
    for name, v in flatten(batch, tree=True).items():
        a = np.asarray(v)
        out[name] = a.astype(object) if a.dtype.kind in "SU" else a
    return out


__all__ = ["RECORD", "RNG", "VALUE", "collate", "elements", "flatten_record", "grain_batch_columns",
           "record_column", "records_of", "records_to_columns", "stack_leaves", "unflatten_columns"]

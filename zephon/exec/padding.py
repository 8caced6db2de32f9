"""Padding rows: what a lane that ran out emits until a finite plan with `remainder="pad"` ends.

A padding row has every field zero (an empty value in a ragged object column) and `valid`
False; a packed padding row therefore also has `segment_ids` 0 and `loss_mask` 0. Its shape and
dtype come from a real row (`Schema`), so a step of padding looks like any other step and
every emitter (numpy, JAX, torch) turns it into the same arrays.

Terms (docs/glossary.md): remainder.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zephon.sources.base import Columns

#: field -> (dtype, per-row shape, blank value for object columns)
Schema = dict[str, tuple[np.dtype, tuple[int, ...], Any]]

VALID = "valid"


def _blank(v: Any) -> Any:
    """The padding value of an object column whose rows look like `v`."""
    if isinstance(v, np.ndarray):
        return np.zeros((0,) + v.shape[1:], v.dtype)
    if isinstance(v, (str, bytes)):
        return type(v)()
    if isinstance(v, (list, tuple)):
        return type(v)()
    return None


def schema_of(cols: Columns) -> Schema | None:
    """The schema of `cols` (None if it has no rows to learn object columns' values from)."""
    if not cols or not len(next(iter(cols.values()))):
        return None
    return {k: (v.dtype, tuple(v.shape[1:]), _blank(v[0]) if v.dtype == object else None)
            for k, v in cols.items()}


def blank_rows(schema: Schema, n: int) -> Columns:
    """`n` padding rows."""
    out: Columns = {}
    for k, (dtype, shape, blank) in schema.items():
        arr = np.zeros((n,) + shape, dtype)
        if arr.dtype == object:
            for i in range(n):
                arr[i] = blank
        out[k] = arr
    return out


def fill_blanks(cols: Columns, invalid: np.ndarray) -> None:
    """Puts the blank value into the object columns' rows `invalid` (zeros elsewhere already)."""
    if not invalid.size:
        return
    for v in cols.values():
        if v.dtype == object:
            ok = np.setdiff1d(np.arange(len(v)), invalid)
            blank = _blank(v[ok[0]]) if ok.size else None
            for i in invalid:
                v[i] = blank


def scatter(cols: Columns, valid: np.ndarray, schema: Schema | None = None) -> Columns:
    """Rows `cols` placed at the True positions of `valid`, padding rows elsewhere (shaped like
    `cols`' rows, or by `schema` when `cols` has none)."""
    use = schema_of(cols) or schema
    if use is None:
        return {}
    out = blank_rows(use, len(valid))
    where = np.flatnonzero(valid)
    for k, v in cols.items():
        out[k][where] = v
    return out


__all__ = ["VALID", "Schema", "blank_rows", "fill_blanks", "scatter", "schema_of"]

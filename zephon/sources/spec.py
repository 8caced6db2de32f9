"""How serialized records become columns.

A spec decodes a whole read at once, so fixed-size records cost one `np.frombuffer` per batch
instead of Python work per record. Specs never see files: the source passes `locate(i)`, which
describes the i-th record of the read (file, shard, record number), so every error can name it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import DecodeError
from .base import Columns

Locate = Callable[[int], str]
FieldSpec = tuple[Any, tuple[int, ...]]


class RecordSpec(Protocol):
    """Decodes the raw records of one read (an object array of bytes, in request order)."""

    def decode(self, records: np.ndarray, locate: Locate) -> Columns: ...


class RawBytes:
    """Hands records over undecoded, for transforms that parse them (tokenizers, protos)."""

    def __init__(self, field: str = "bytes") -> None:
        self.field = field

    def __repr__(self) -> str:
        return f"RawBytes(field={self.field!r})"

    def decode(self, records: np.ndarray, locate: Locate) -> Columns:
        return {self.field: records}


class FixedFields:
    """Records made of fixed-size numpy fields laid out back to back, in declaration order.

    Because every record has the same byte length, a batch decodes with one `np.frombuffer`
    over the joined records; the result fields are C-contiguous, aligned and writable so
    backends can hand them to torch/jax without another copy.
    """

    def __init__(self, fields: Mapping[str, FieldSpec]) -> None:
        if not fields:
            raise ValueError("FixedFields needs at least one field, "
                             "e.g. {'tokens': ('int32', (256,))}")
        self.fields: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, field_spec in fields.items():
            try:
                dtype, shape = field_spec
                dt = np.dtype(dtype)
                shp = (int(shape),) if isinstance(shape, (int, np.integer)) else \
                    tuple(int(d) for d in shape)
            except (TypeError, ValueError) as e:
                raise ValueError(f"FixedFields field {name!r}: {field_spec!r} is not (dtype, shape) "
                                 f"({e}); write e.g. {{{name!r}: ('int32', (256,))}}.") from None
            if any(d < 0 for d in shp):
                raise ValueError(f"FixedFields field {name!r}: shape {shp} has a negative size")
            if dt.hasobject:
                raise ValueError(f"FixedFields field {name!r}: dtype {dt} is not fixed-size")
            nbytes = dt.itemsize * math.prod(shp)
            self.fields[name] = (dt, shp)
            self._offsets[name] = (offset, nbytes)
            offset += nbytes
        self.record_nbytes = offset

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: ({str(dt)!r}, {shp})" for k, (dt, shp) in self.fields.items())
        return f"FixedFields({{{inner}}})"

    def encode(self, record: Mapping[str, Any]) -> bytes:
        """Serializes one record; the writer-side inverse of `decode`, for tests and tools."""
        if set(record) != set(self.fields):
            raise ValueError(f"{self!r}.encode: record has fields {sorted(record)}, "
                             f"expected exactly {sorted(self.fields)}")
        parts = []
        for name, (dt, shape) in self.fields.items():
            value = np.asarray(record[name])
            if value.shape != shape:
                raise ValueError(f"{self!r}.encode: field {name!r} has shape {value.shape}, "
                                 f"expected {shape}")
            parts.append(np.ascontiguousarray(value.astype(dt, casting="same_kind")).tobytes())
        return b"".join(parts)

    def decode(self, records: np.ndarray, locate: Locate) -> Columns:
        n = len(records)
        lengths = np.fromiter(map(len, records), dtype=np.int64, count=n)
        bad = np.flatnonzero(lengths != self.record_nbytes)
        if bad.size:
            i = int(bad[0])
            raise DecodeError(
                f"{locate(i)}: record is {int(lengths[i])} bytes but {self!r} expects "
                f"{self.record_nbytes} bytes ({bad.size} of {n} records in this read differ). "
                "The data was written with another layout: fix the spec's fields, dtypes and "
                "shapes to match the writer, or rewrite the data.")
        # bytearray.join gives one writable buffer, so a single-field layout needs no copy.
        buf = np.frombuffer(bytearray().join(records), dtype=np.uint8)
        buf = buf.reshape(n, self.record_nbytes)
        out: Columns = {}
        for name, (dt, shape) in self.fields.items():
            start, nbytes = self._offsets[name]
            whole = nbytes == self.record_nbytes
            raw = buf if whole else np.ascontiguousarray(buf[:, start:start + nbytes])
            out[name] = raw.view(dt).reshape((n, *shape))
        return out


class Decoder:
    """Wraps a user function `bytes -> dict[str, value]`; its rows are stacked into columns.

    This is the per-record escape hatch (protos, msgpack, images); prefer FixedFields when the
    layout is fixed, because it decodes a whole read without Python work per record. Name
    variable-length fields in `ragged` so they are object arrays in every read (see
    `rows_to_columns`).
    """

    def __init__(self, fn: Callable[[bytes], Mapping[str, Any]],
                 ragged: Collection[str] = ()) -> None:
        self.fn = fn
        self.ragged = frozenset(ragged)

    def __repr__(self) -> str:
        return f"Decoder({getattr(self.fn, '__qualname__', self.fn)!r})"

    def decode(self, records: np.ndarray, locate: Locate) -> Columns:
        rows = []
        for i, record in enumerate(records):
            try:
                row = self.fn(record)
            except Exception as e:
                raise DecodeError(f"{locate(i)}: {self!r} raised {type(e).__name__}: {e}. Fix the "
                                  "decoder, or the record if it is damaged.") from e
            if not isinstance(row, Mapping):
                raise DecodeError(f"{locate(i)}: {self!r} returned {type(row).__name__}; a decoder "
                                  "must return a dict of field name -> value.")
            rows.append(row)
        return rows_to_columns(rows, locate, self.ragged)


def rows_to_columns(rows: Sequence[Mapping[str, Any]], locate: Locate,
                    ragged: Collection[str] = ()) -> Columns:
    """Stacks per-record dicts (nested keys joined with '/') into columns.

    Every record must have the same fields: filling a missing one would change a column's dtype
    depending on which records a read happened to touch, and so on the number of ranks. For the
    same reason, fields a schema declares variable-size (`ragged`) are always object arrays, even
    when the rows of one read happen to agree in shape.
    """
    flat = [flatten_dict(row) for row in rows]
    if not flat:
        return {}
    keys = list(flat[0])
    unknown = sorted(set(ragged) - set(keys))
    if unknown:
        raise DecodeError(f"{locate(0)}: ragged names {unknown}, which the record does not have "
                          f"(it has {sorted(keys)}); fix the names given to `ragged`.")
    for i, row in enumerate(flat):
        if row.keys() != flat[0].keys():
            raise DecodeError(f"{locate(i)}: has fields {sorted(row)} but {locate(0)} has "
                              f"{sorted(keys)}; every record of a source must have the same "
                              "fields.")
    columns = {}
    for k in keys:
        values = [row[k] for row in flat]
        columns[k] = _objects(values) if k in ragged else stack_values(values)
    return columns


def stack_values(values: Sequence[Any]) -> np.ndarray:
    """Numbers and equal-shape numeric arrays stack into one ndarray; anything else (text, bytes,
    ragged lists) becomes an object array holding the values unchanged. Rows that are all empty
    lists stay objects: numpy would call them float64 and poison integer token streams."""
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):  # ragged nesting
        arr = None
    if arr is not None and arr.dtype.kind in "biufc" and arr.shape[:1] == (len(values),) \
            and (arr.size or arr.ndim == 1):
        return arr
    return _objects(values)


def _objects(values: Sequence[Any]) -> np.ndarray:
    # fromiter, unlike np.array, never descends into list or array values.
    return np.fromiter(values, dtype=object, count=len(values))


def flatten_dict(row: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a/b': 1}: nested features become flat column names."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, Mapping):
            out.update(flatten_dict(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out

"""How serialized records become columns.

A spec decodes a whole read at once, so fixed-size records cost one `np.frombuffer` per batch
instead of Python work per record. Specs never see files: the source passes `locate(i)`, which
describes the i-th record of the read (file, shard, record number), so every error can name it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import numpy as np

from ..errors import DecodeError
from .base import Columns
from .columns import to_columns

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
    variable-length fields in `ragged` so they are object arrays in every read (the rule is
    `zephon.sources.columns`).
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
        return to_columns(rows, locate, self.ragged)

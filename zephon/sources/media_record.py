"""A record spec for encoded media plus metadata in one serialized record (ArrayRecord, anything
that stores opaque bytes per record).

Layout: `b"ZMR1"`, a little-endian uint32 header length, a UTF-8 JSON header, then the payloads
back to back. The header holds the metadata values (numbers, strings, lists) and, for each bytes
field, `[offset, length]` into the payloads. Why not pickle: a record must be readable without
running code from the file; why not a protobuf: no schema compiler or TensorFlow needed to write
or read one. `MediaRecord().encode({...})` writes one; `ArrayRecordSource(path, MediaRecord())`
reads them back as columns (bytes fields as object arrays for `zephon.media.DecodeImage`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ..errors import DecodeError
from .base import Columns
from .columns import to_columns
from .spec import Locate

MAGIC = b"ZMR1"


class MediaRecord:
    """Encodes / decodes `{field: bytes | number | str | list}` records (see module doc).

    ragged: metadata fields that are lists of varying length (object arrays in every read)."""

    def __init__(self, ragged: Collection[str] = ()) -> None:
        self.ragged = frozenset(ragged)

    def __repr__(self) -> str:
        return f"MediaRecord(ragged={sorted(self.ragged)})"

    @staticmethod
    def encode(record: Mapping[str, Any]) -> bytes:
        meta: dict[str, Any] = {}
        spans: dict[str, list[int]] = {}
        payload = bytearray()
        for k, v in record.items():
            if isinstance(v, (bytes, bytearray, memoryview)):
                spans[k] = [len(payload), len(v)]
                payload += bytes(v)
            else:
                meta[k] = v.tolist() if isinstance(v, (np.ndarray, np.generic)) else v
        head = json.dumps({"meta": meta, "bytes": spans}, sort_keys=True, allow_nan=False).encode()
        return MAGIC + struct.pack("<I", len(head)) + head + bytes(payload)

    def decode(self, records: np.ndarray, locate: Locate) -> Columns:
        rows = []
        for i, rec in enumerate(records):
            b = bytes(rec)
            if b[:4] != MAGIC or len(b) < 8:
                raise DecodeError(f"{locate(i)}: not a MediaRecord (first bytes {b[:8]!r}); write "
                                  "records with MediaRecord.encode, or read them with RawBytes")
            (n,) = struct.unpack("<I", b[4:8])
            try:
                head = json.loads(b[8:8 + n])
            except ValueError as e:
                raise DecodeError(f"{locate(i)}: MediaRecord header is not JSON ({e})") from e
            base = 8 + n
            row = dict(head["meta"])
            for k, (off, ln) in head["bytes"].items():
                if base + off + ln > len(b):
                    raise DecodeError(f"{locate(i)}: field {k!r} of the MediaRecord needs bytes up to "
                                      f"{base + off + ln} but the record has {len(b)}: truncated")
                row[k] = b[base + off: base + off + ln]
            rows.append(row)
        return to_columns(rows, locate, ragged=self.ragged)

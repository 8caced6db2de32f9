"""ArrayRecord files read through byte ranges (object storage), without ArrayRecord's reader.

ArrayRecord's C++ reader cannot read s3://, and on gs:// it can block for minutes on a dead
endpoint without raising. An ArrayRecord file is a Riegeli file whose footer lists where every
chunk starts, so this reads the footer once (two ranged reads: the 64 KiB-aligned postscript,
then the footer chunk) and afterwards turns records into chunk byte ranges, fetched concurrently
by `zephon.storage` under its timeouts, retries and version pin.

Riegeli in brief (all little-endian): a 24-byte block header sits at every multiple of 64 KiB
and interrupts whatever chunk crosses it; a chunk is a 40-byte header (header hash, data size,
data hash, type, record count, decoded size) and its data. A simple chunk ('r') holds a
compression byte (0 none, 'z' zstd, 'b' brotli, 's' snappy), the varint length of the
compressed record sizes, the sizes (varints) and the concatenated records, each part compressed
with its decompressed length as a varint prefix. Transposed chunks (`transpose` writer option)
are not supported: such a file is refused with a clear error. The Riegeli hashes (HighwayHash)
are not verified here; sizes and decompression are, so damage is an error, not silent garbage,
in all but unlucky cases.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import SourceError
from ..storage import Blob, is_remote, open_blob

BLOCK = 1 << 16
BLOCK_HEADER = 24
CHUNK_HEADER = 40
_CODECS = {ord("z"): "zstd", ord("b"): "brotli", ord("s"): "snappy"}


def strip_block_headers(data: bytes, start: int) -> bytes:
    """The logical bytes of physical `data` that begins at file position `start`."""
    first = -(-start // BLOCK) * BLOCK
    if first >= start + len(data):
        return data
    parts, pos = [], 0
    for b in range(first, start + len(data), BLOCK):
        rel = b - start
        parts.append(data[pos:rel])
        pos = min(rel + BLOCK_HEADER, len(data))
    parts.append(data[pos:])
    return b"".join(parts)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def varints(buf: bytes, count: int) -> np.ndarray:
    """`count` varints packed in `buf` (vectorised: a footer lists every chunk)."""
    b = np.frombuffer(buf, dtype=np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if len(ends) != count or (count and ends[-1] != len(b) - 1):
        raise ValueError(f"expected {count} varints in {len(b)} bytes, found {len(ends)}")
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    group = np.repeat(np.arange(count), ends - starts + 1)
    shift = (np.arange(len(b)) - starts[group]) * 7
    vals = (b & 0x7F).astype(np.uint64) << shift.astype(np.uint64)
    return np.add.reduceat(vals, starts).astype(np.int64)


def _decompress(ctype: int, data: bytes) -> bytes:
    if ctype == 0:
        return data
    codec = _CODECS.get(ctype)
    if codec is None:
        raise ValueError(f"unknown compression type {ctype!r}")
    size, pos = _varint(data, 0)
    import pyarrow as pa

    return pa.decompress(data[pos:], decompressed_size=size, codec=codec).to_pybytes()


def decode_chunk(logical: bytes) -> list[bytes]:
    """The records of one chunk (`logical`: header + data, block headers removed)."""
    if len(logical) < CHUNK_HEADER:
        raise ValueError(f"chunk of {len(logical)} bytes is shorter than its header")
    data_size = int.from_bytes(logical[8:16], "little")
    ctype_chunk = logical[24]
    num_records = int.from_bytes(logical[25:32], "little")
    data = logical[CHUNK_HEADER:CHUNK_HEADER + data_size]
    if len(data) != data_size:
        raise ValueError(f"chunk data is {len(data)} bytes, its header says {data_size}")
    if ctype_chunk != ord("r"):
        what = {ord("t"): "a transposed chunk (writer option transpose)"}.get(ctype_chunk,
                                                                             f"chunk type {ctype_chunk!r}")
        raise ValueError(f"{what} is not supported for object storage; rewrite the file with "
                         "zephon.sources.write_array_record (simple chunks)")
    ctype = data[0]
    sizes_len, pos = _varint(data, 1)
    sizes = varints(_decompress(ctype, data[pos:pos + sizes_len]), num_records)
    values = _decompress(ctype, data[pos + sizes_len:])
    if int(sizes.sum()) != len(values):
        raise ValueError(f"record sizes add up to {int(sizes.sum())} bytes, values are {len(values)}")
    cuts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [values[a:b] for a, b in itertools.pairwise(cuts)]


def _proto_fields(msg: bytes) -> dict[int, int]:
    """The varint fields of a small protobuf message (field number -> value)."""
    out, pos = {}, 0
    while pos < len(msg):
        key, pos = _varint(msg, pos)
        if key & 7 == 0:
            out[key >> 3], pos = _varint(msg, pos)
        elif key & 7 == 2:
            n, pos = _varint(msg, pos)
            pos += n
        elif key & 7 == 1:
            pos += 8
        elif key & 7 == 5:
            pos += 4
        else:
            raise ValueError(f"unexpected protobuf wire type {key & 7}")
    return out


@dataclass
class RangedArrayRecord:
    """One ArrayRecord file read by ranges: the reader API of `ArrayRecordReader` that the
    source uses (`num_records`, `read(indices)`, `close`)."""

    blob: Blob
    chunk_begin: np.ndarray = field(init=False)
    chunk_end: np.ndarray = field(init=False)
    chunk_first: np.ndarray = field(init=False)  # first record of each chunk
    _lock: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        try:
            self._read_footer()
        except ValueError as e:
            raise SourceError(f"ArrayRecord file {self.blob.url!r} cannot be opened: {e}. It is "
                              "truncated, corrupt or not an ArrayRecord file; rewrite it (or "
                              "restore it from the original) before reading.") from e

    def _chunk(self, begin: int, end: int) -> list[bytes]:
        return decode_chunk(strip_block_headers(self.blob.read(begin, end - begin), begin))

    def _read_footer(self) -> None:
        size = self.blob.size
        if size < BLOCK_HEADER + CHUNK_HEADER:
            raise ValueError(f"{size} bytes is too short")
        post = ((size - 1) // BLOCK) * BLOCK
        footer_offset = None
        for record in self._chunk(post, size):
            fields_ = _proto_fields(record)
            if 1 in fields_:
                footer_offset = fields_[1]
                break
        if footer_offset is None or not 0 < footer_offset <= post:
            raise ValueError("its postscript names no footer")
        records = self._chunk(footer_offset, post)
        if not records:
            raise ValueError("its footer is empty")
        meta = _proto_fields(records[0][2:]) if records[0][:1] == b"\x0a" else {}
        entries = [_proto_fields(r) for r in records[1:]]
        if meta.get(2, len(entries)) != len(entries):
            raise ValueError(f"its footer lists {len(entries)} chunks but says {meta.get(2)}")
        begins = np.array([e.get(1, 0) for e in entries], dtype=np.int64)
        counts = np.array([e.get(3, 0) for e in entries], dtype=np.int64)
        if len(begins) and (np.any(np.diff(begins) <= 0) or begins[-1] >= footer_offset):
            raise ValueError("its chunk offsets are not increasing within the data")
        self.chunk_begin = begins
        self.chunk_end = np.concatenate([begins[1:], [footer_offset]]).astype(np.int64)
        self.chunk_first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def ok(self) -> bool:
        return True

    def num_records(self) -> int:
        return int(self.chunk_first[-1])

    def writer_options_string(self) -> str:
        return ""

    def close(self) -> None:
        pass

    def read(self, indices: list[int]) -> list[bytes]:
        """Records at `indices` (in that order): each chunk touched is fetched and decoded once."""
        idx = np.asarray(indices, dtype=np.int64)
        chunk = np.searchsorted(self.chunk_first, idx, side="right") - 1
        wanted = np.unique(chunk)
        ranges = [(int(self.chunk_begin[c]), int(self.chunk_end[c] - self.chunk_begin[c]))
                  for c in wanted.tolist()]
        raw = self.blob.read_ranges(ranges)
        decoded: dict[int, list[bytes]] = {}
        for c, (begin, _), data in zip(wanted.tolist(), ranges, raw):
            try:
                decoded[c] = decode_chunk(strip_block_headers(data, begin))
            except ValueError as e:
                raise RuntimeError(f"chunk at byte {begin} is damaged: {e}") from e
        local = (idx - self.chunk_first[chunk]).tolist()
        return [decoded[c][r] for c, r in zip(chunk.tolist(), local)]


_footers: dict[tuple[str, str], RangedArrayRecord] = {}
_footers_lock = threading.Lock()


def pin(path: str) -> Blob | None:
    """The pinned version of an object URL (None for a local path, read by ArrayRecord's reader)."""
    return open_blob(path) if is_remote(path) else None


def ranged_reader(blob: Blob) -> RangedArrayRecord:
    """The reader of `blob`; its footer is read once per process and version (URL, ETag)."""
    key = (blob.url, blob.version)
    with _footers_lock:
        found = _footers.get(key)
    if found is None:
        found = RangedArrayRecord(blob)
        with _footers_lock:
            if len(_footers) > 4096:
                _footers.clear()
            found = _footers.setdefault(key, found)
    return found

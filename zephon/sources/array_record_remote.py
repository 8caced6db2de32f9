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
from ..storage import Blob, is_remote, open_blob, read_blobs

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


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
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


def varints(buf: bytes | memoryview, count: int) -> np.ndarray:
    """`count` varints packed in `buf` (vectorised: a footer lists every chunk)."""
    b = np.frombuffer(buf, dtype=np.uint8)
    ends = np.flatnonzero(b < 0x80)
    if len(ends) != count or (count and ends[-1] != len(b) - 1):
        raise ValueError(f"expected {count} varints in {len(b)} bytes, found {len(ends)}")
    return _varints_ending(b, ends)


def _varints_ending(b: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The varints of bytes `b` whose last bytes are at `ends` (all of them, in order)."""
    if not len(ends):
        return np.zeros(0, dtype=np.int64)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    extra = ends - starts  # bytes after a varint's first
    top = int(extra.max())
    if top > 9:
        raise ValueError("a varint longer than 10 bytes")
    vals = (b[starts] & 0x7F).astype(np.int64)
    longer = np.arange(len(ends))
    for k in range(1, top + 1):  # byte k of the varints that have one
        longer = longer[extra[longer] >= k]
        vals[longer] |= (b[starts[longer] + k] & 0x7F).astype(np.int64) << (7 * k)
    return vals


_local = threading.local()


def _decompress(ctype: int, data: bytes) -> bytes:
    if ctype == 0:
        return data
    codec = _CODECS.get(ctype)
    if codec is None:
        raise ValueError(f"unknown compression type {ctype!r}")
    size, pos = _varint(data, 0)
    if codec == "zstd":
        zstd = _zstd()
        if zstd is not None:  # ~5 us a 1 KiB record; pyarrow's wrapper costs ~25 us a call
            try:
                out: bytes = zstd.decompress(data[pos:], max_output_size=size)
            except Exception as e:  # zstandard.ZstdError: damaged data
                raise ValueError(f"zstd: {e}") from None
            if len(out) != size:
                raise ValueError(f"decompressed to {len(out)} bytes, expected {size}")
            return out
    import pyarrow as pa

    return pa.decompress(data[pos:], decompressed_size=size, codec=codec).to_pybytes()


def _zstd() -> Any:
    """This thread's zstandard decompressor (one per thread: they are not thread safe), or None
    without the package (the `remote` extra installs it; pyarrow decodes then, slower)."""
    try:
        return _local.zstd
    except AttributeError:
        try:
            import zstandard
        except ImportError:
            _local.zstd = None
        else:
            _local.zstd = zstandard.ZstdDecompressor()
        return _local.zstd


def chunk_values(logical: bytes) -> tuple[np.ndarray | None, bytes]:
    """(record sizes, concatenated records) of one chunk (`logical`: header + data, block
    headers removed); sizes is None for a one-record chunk (the `group_size:1` files Zephon
    writes), whose record is all of the values: its sizes are then not even decompressed."""
    if len(logical) < CHUNK_HEADER:
        raise ValueError(f"chunk of {len(logical)} bytes is shorter than its header")
    data_size = int.from_bytes(logical[8:16], "little")
    ctype_chunk = logical[24]
    num_records = int.from_bytes(logical[25:32], "little")
    decoded_size = int.from_bytes(logical[32:40], "little")
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
    values = _decompress(ctype, data[pos + sizes_len:])
    if len(values) != decoded_size:
        raise ValueError(f"records are {len(values)} bytes, the chunk header says {decoded_size}")
    if num_records == 1:
        return None, values
    sizes = varints(_decompress(ctype, data[pos:pos + sizes_len]), num_records)
    if int(sizes.sum()) != len(values):
        raise ValueError(f"record sizes add up to {int(sizes.sum())} bytes, values are {len(values)}")
    return sizes, values


def decode_chunk(logical: bytes) -> list[bytes]:
    """The records of one chunk (`logical`: header + data, block headers removed)."""
    sizes, values = chunk_values(logical)
    if sizes is None:
        return [values]
    cuts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [values[a:b] for a, b in itertools.pairwise(cuts)]


#: footer entries parsed at a time: a block's temporaries (~1 MB) stay in cache and are reused,
#: where a whole footer's (~100 MB for 190k chunks) was fresh memory, and page faults, on every open
ENTRY_BLOCK = 16384


def index_entries(values: bytes, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(chunk offset, record count) of every footer entry, vectorised: a footer lists every
    chunk (a million for a million records at group_size:1), and parsing the entries one by one
    in Python took seconds. Each entry is a protobuf message of varint fields (1: chunk offset,
    3: records); anything else falls back to the entry-by-entry parser."""
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    view = memoryview(values)
    cuts = [*range(0, len(sizes), ENTRY_BLOCK), len(sizes)]
    parts = [_index_block(view[bounds[i]:bounds[j]], sizes[i:j]) for i, j in itertools.pairwise(cuts)]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _index_block(values: memoryview, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = len(sizes)
    b = np.frombuffer(values, dtype=np.uint8)
    ends = np.flatnonzero(b < 0x80)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    if len(ends) and ends[-1] == len(b) - 1 and np.all(sizes > 0):
        try:
            vals = _varints_ending(b, ends)
        except ValueError:
            vals = None
        cum = np.searchsorted(ends, bounds - 1, side="right")  # varints ending before each entry
        per = np.diff(cum)
        # every entry ends on a varint's end and holds (key, value) pairs: then the keys are the
        # varints at even positions of the whole block, and an entry's pairs are contiguous
        if vals is not None and np.array_equal(ends[cum[1:] - 1], bounds[1:] - 1) and np.all(per % 2 == 0):
            keys, fields_ = vals[0::2], vals[1::2]
            if np.all(keys & 7 == 0):
                field_no, owner = keys >> 3, np.repeat(np.arange(n), per // 2)
                begins = np.zeros(n, np.int64)
                counts = np.zeros(n, np.int64)
                begins[owner[field_no == 1]] = fields_[field_no == 1]
                counts[owner[field_no == 3]] = fields_[field_no == 3]
                return begins, counts
    entries = [_proto_fields(values[a:e]) for a, e in itertools.pairwise(bounds.tolist())]
    return (np.array([e.get(1, 0) for e in entries], dtype=np.int64),
            np.array([e.get(3, 0) for e in entries], dtype=np.int64))


def _proto_fields(msg: bytes | memoryview) -> dict[int, int]:
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
        raw = self.blob.read(footer_offset, post - footer_offset)
        sizes, values = chunk_values(strip_block_headers(raw, footer_offset))
        if sizes is None:
            sizes = np.array([len(values)], np.int64)
        if not len(sizes):
            raise ValueError("its footer is empty")
        head = values[:int(sizes[0])]
        meta = _proto_fields(head[2:]) if head[:1] == b"\x0a" else {}
        begins, counts = index_entries(values[int(sizes[0]):], sizes[1:])
        if meta.get(2, len(begins)) != len(begins):
            raise ValueError(f"its footer lists {len(begins)} chunks but says {meta.get(2)}")
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
        return read_records([self], [np.asarray(indices, dtype=np.int64)])[0]

    def chunks_of(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """(chunk of each record, the chunks touched, their byte ranges)."""
        chunk = np.searchsorted(self.chunk_first, idx, side="right") - 1
        wanted = np.unique(chunk)
        begin, end = self.chunk_begin[wanted], self.chunk_end[wanted]
        return chunk, wanted, list(zip(begin.tolist(), (end - begin).tolist()))

    def records_of(self, idx: np.ndarray, chunk: np.ndarray, wanted: np.ndarray,
                   ranges: list[tuple[int, int]], raw: list[bytes]) -> list[bytes]:
        decoded: dict[int, list[bytes]] = {}
        for c, (begin, _), data in zip(wanted.tolist(), ranges, raw):
            try:
                decoded[c] = decode_chunk(strip_block_headers(data, begin))
            except ValueError as e:
                raise RuntimeError(f"chunk at byte {begin} is damaged: {e}") from e
        local = (idx - self.chunk_first[chunk]).tolist()
        return [decoded[c][r] for c, r in zip(chunk.tolist(), local)]


def decode_run(data: bytes, start: int, begins: np.ndarray) -> list[bytes]:
    """The records of a run of consecutive chunks fetched as one range: `data` is the physical
    bytes from file position `start` (the first chunk's) to the end of the last, `begins` the
    chunks' positions. One-record zstd (or uncompressed) chunks — what Zephon writes — take a
    fast path: every header parsed at once with numpy, then one decompress call per record;
    anything else is decoded chunk by chunk."""
    logical = strip_block_headers(data, start)
    rel = begins - start
    # Block headers removed before each chunk: those at boundaries in [start, begin) — a chunk
    # may begin right at a boundary, its bytes after that boundary's header.
    off = rel - BLOCK_HEADER * ((begins + BLOCK - 1) // BLOCK - (start + BLOCK - 1) // BLOCK)
    ends = np.append(off[1:], len(logical))
    b = np.frombuffer(logical, dtype=np.uint8)
    if len(b) < int(off[-1]) + CHUNK_HEADER + 4:
        raise ValueError("a run of chunks is truncated")

    def u64(at: np.ndarray, nbytes: int = 8) -> np.ndarray:
        v = np.zeros(len(at), np.int64)
        for k in range(nbytes):
            v |= b[at + k].astype(np.int64) << (8 * k)
        return v

    data_size, ctype_chunk = u64(off + 8), b[off + 24]
    records, decoded_size = u64(off + 25, 7), u64(off + 32)
    d = off + CHUNK_HEADER
    simple = (np.all(ctype_chunk == ord("r")) and np.all(records == 1)
              and np.all(d + data_size == ends) and np.all(b[d + 1] < 0x80))
    codec = int(b[d[0]]) if simple else -1
    if simple and codec in (0, ord("z")) and np.all(b[d] == codec):
        vstart = d + 2 + b[d + 1].astype(np.int64)  # past the codec byte, the sizes' length, the sizes
        if codec == 0:
            return [logical[x:y] for x, y in zip(vstart.tolist(), (d + data_size).tolist())]
        sizes, vstart = _small_varints(b, vstart)
        zstd = _zstd()
        if zstd is not None and np.all(sizes == decoded_size):
            many = _decompress_many(zstd, logical, vstart, d + data_size, sizes)
            if many is not None:
                return many
            view = memoryview(logical)
            out = []
            for x, y, n in zip(vstart.tolist(), (d + data_size).tolist(), sizes.tolist()):
                rec = zstd.decompress(view[x:y], max_output_size=n)
                if len(rec) != n:
                    raise ValueError(f"decompressed to {len(rec)} bytes, expected {n}")
                out.append(rec)
            return out
    return [r for x, y in zip(off.tolist(), ends.tolist()) for r in decode_chunk(logical[x:y])]


def _decompress_many(zstd: Any, buf: bytes, starts: np.ndarray, ends: np.ndarray,
                     sizes: np.ndarray) -> list[bytes] | None:
    """Every zstd frame `buf[starts[i]:ends[i]]` decompressed in one call of the C extension, on
    the calling thread without the GIL (no Python per record but the result's bytes; `read_runs`
    decodes its rounds on several threads at once, so threads of zstd's own would only compete
    with them for the cores); None where that call is
    unavailable (zstandard's cffi backend) or refuses the input."""
    import zstandard

    if not hasattr(zstd, "multi_decompress_to_buffer") or len(starts) < 64:
        return None
    try:
        segments = np.stack([starts, ends - starts], axis=1).astype(np.uint64)
        frames = zstandard.BufferWithSegments(buf, segments.tobytes())
        got = zstd.multi_decompress_to_buffer(frames, decompressed_sizes=sizes.astype(np.uint64).tobytes(),
                                              threads=0)
    except (zstandard.ZstdError, ValueError, TypeError):
        return None
    out = [got[i].tobytes() for i in range(len(got))]
    if any(len(o) != n for o, n in zip(out, sizes.tolist())):
        raise ValueError("a record decompressed to another size than its chunk says")
    return out


def _small_varints(b: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, positions after them) of varints of up to 4 bytes starting at `at` (vectorised)."""
    vals = np.zeros(len(at), np.int64)
    pos = at.copy()
    live = np.ones(len(at), bool)
    for k in range(4):
        byte = b[pos[live]].astype(np.int64)
        vals[live] |= (byte & 0x7F) << (7 * k)
        pos[live] += 1
        idx = np.flatnonzero(live)
        live[idx[byte < 0x80]] = False
        if not live.any():
            return vals, pos
    raise ValueError("a record size varint longer than 4 bytes")


#: spans fetched per request round of `read_runs`: the rounds overlap (in threads) with the
#: decoding of the rounds before them, so a read of many blocks decodes while it downloads
RUN_GROUP = 8
_run_pool: Any = None
_run_pool_lock = threading.Lock()


def _fetch_pool() -> Any:
    global _run_pool
    with _run_pool_lock:
        if _run_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _run_pool = ThreadPoolExecutor(8, thread_name_prefix="zephon-runs")
        return _run_pool


def read_runs(readers: list[RangedArrayRecord], spans: list[tuple[int, int]]) -> list[list[bytes]]:
    """The records `lo..hi-1` of `readers[k]` for each `spans[k]` (records of whole chunks are
    fetched as one range per span and decoded together): the block shuffle's whole-block read.
    Spans go out in rounds of `RUN_GROUP`, all rounds at once; each round is decoded by the
    thread that fetched it as soon as it arrives (zstd releases the GIL), so decoding runs on
    every core while the other rounds download, not one round at a time after them."""
    plans = []
    for r, (lo, hi) in zip(readers, spans):
        c0 = int(np.searchsorted(r.chunk_first, lo, side="right") - 1)
        c1 = int(np.searchsorted(r.chunk_first, hi - 1, side="right") - 1)
        plans.append((c0, c1, int(r.chunk_begin[c0]), int(r.chunk_end[c1])))
    ks = list(range(len(plans)))
    groups = [ks[i:i + RUN_GROUP] for i in range(0, len(ks), RUN_GROUP)]

    def one(k: int, raw: bytes) -> list[bytes]:
        r, (lo, hi), (c0, c1, a, _) = readers[k], spans[k], plans[k]
        try:
            recs = decode_run(raw, a, r.chunk_begin[c0:c1 + 1])
        except ValueError as e:
            raise RuntimeError(f"chunks at bytes {a}.. are damaged: {e}") from e
        first = int(r.chunk_first[c0])
        return recs[lo - first:hi - first]

    def round_(group: list[int]) -> list[list[bytes]]:
        by_file: dict[int, list[int]] = {}  # a round's spans of one file: touching ones share a GET
        for k in group:
            by_file.setdefault(id(readers[k]), []).append(k)
        files = list(by_file.values())
        raws = read_blobs([(readers[ks[0]].blob, [(plans[k][2], plans[k][3] - plans[k][2]) for k in ks])
                           for ks in files], overfetch=0)
        got = {k: raw for ks, data in zip(files, raws) for k, raw in zip(ks, data)}
        return [one(k, got[k]) for k in group]

    if len(groups) <= 1:
        return [recs for g in groups for recs in round_(g)]
    pool = _fetch_pool()
    futures = [pool.submit(round_, g) for g in groups]
    out: list[list[bytes]] = []
    try:
        for f in futures:
            out.extend(f.result())
    finally:
        for f in futures:
            f.cancel()
    return out


def read_records(readers: list[RangedArrayRecord], indices: list[np.ndarray]) -> list[list[bytes]]:
    """The records at `indices[k]` of `readers[k]`, for all readers at once: the chunks of every
    file are requested together (one round of requests for a read across shards)."""
    plans = [r.chunks_of(idx) for r, idx in zip(readers, indices)]
    raws = read_blobs([(r.blob, ranges) for r, (_, _, ranges) in zip(readers, plans)])
    return [r.records_of(idx, chunk, wanted, ranges, raw)
            for r, idx, (chunk, wanted, ranges), raw in zip(readers, indices, plans, raws)]


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

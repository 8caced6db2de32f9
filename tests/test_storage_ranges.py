"""The ranged-read planning and ArrayRecord decoding behind object storage, on local files (no
servers): request merging under a byte budget, vectorised varints and footer entries, chunks of
every writer layout decoded to the writer's records."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from zephon.sources import array_record_remote, write_array_record
from zephon.sources.array_record_remote import (
    RangedArrayRecord,
    _proto_fields,
    chunk_values,
    index_entries,
    strip_block_headers,
    varints,
)
from zephon.storage import open_blob
from zephon.storage.ranges import plan_requests


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


@pytest.mark.parametrize("overfetch", [0.0, 0.3, 0.8, 2.0])
def test_requests_cover_every_range_within_the_byte_budget(overfetch):
    rng = np.random.default_rng(int(overfetch * 10))
    starts = np.sort(rng.choice(10_000_000, 3000, replace=False))
    lengths = rng.integers(1, 3000, 3000)
    lengths = np.minimum(lengths, np.diff(np.append(starts, 10**8)))  # disjoint ranges
    ranges = list(zip(starts.tolist(), lengths.tolist()))
    rng.shuffle(ranges)
    gap, max_request = 20_000, 1 << 20
    requests, where = plan_requests(ranges, gap, max_request, overfetch)
    asked = sum(n for _, n in ranges)
    fetched = sum(e - s for s, e in requests)
    assert asked <= fetched <= (1 + overfetch) * asked
    for (o, n), (r, off) in zip(ranges, where):
        s, e = requests[r]
        assert s + off == o and o + n <= e
    spans = sorted(requests)
    assert all(b[0] > a[1] for a, b in itertools.pairwise(spans))  # requests are disjoint
    assert all(e - s <= max_request for s, e in requests)
    inside: dict[int, list[tuple[int, int]]] = {}
    for (o, n), (r, _) in zip(ranges, where):
        inside.setdefault(r, []).append((o, o + n))
    for parts in inside.values():  # no gap inside a request is longer than `gap`
        parts.sort()
        assert all(b[0] - a[1] <= gap for a, b in itertools.pairwise(parts))
    if overfetch == 0:
        assert fetched == asked
    if overfetch >= 0.8:  # the budget buys fewer requests than ranges
        assert len(requests) < 0.8 * len(ranges)


def test_overlapping_and_touching_ranges_share_a_request():
    requests, where = plan_requests([(100, 50), (120, 10), (150, 5), (400, 10)], 0, 1 << 20)
    assert requests == [(100, 155), (400, 410)]
    assert where == [(0, 0), (0, 20), (0, 50), (1, 0)]


def test_varints_decode_one_to_ten_byte_values():
    rng = np.random.default_rng(1)
    values = [0, 1, 127, 128, 300, 2**35, 2**62] + (rng.integers(0, 2**40, 500) >> rng.integers(0, 40, 500)).tolist()
    buf = b"".join(_varint(int(v)) for v in values)
    assert varints(buf, len(values)).tolist() == values
    with pytest.raises(ValueError):
        varints(buf[:-1], len(values))


def test_footer_entries_parse_like_the_entry_by_entry_parser():
    entries = [_varint(8) + _varint(off) + _varint(16) + _varint(9000 + off) + _varint(24) + _varint(cnt)
               for off, cnt in [(0, 1), (700, 1), (2**20 + 5, 3), (2**33, 1)]]
    entries.append(_varint(24) + _varint(2) + _varint(8) + _varint(77))  # other field order
    sizes = np.array([len(e) for e in entries])
    begins, counts = index_entries(b"".join(entries), sizes)
    slow = [_proto_fields(e) for e in entries]
    assert begins.tolist() == [f.get(1, 0) for f in slow]
    assert counts.tolist() == [f.get(3, 0) for f in slow]
    odd = [_varint(8) + _varint(5), _varint(2 << 3 | 2) + _varint(2) + b"ab"]  # a bytes field
    begins, counts = index_entries(b"".join(odd), np.array([len(e) for e in odd]))
    assert begins.tolist() == [5, 0] and counts.tolist() == [0, 0]


def test_footer_entries_parse_across_blocks(monkeypatch):
    """A footer is parsed a block of entries at a time: block edges, a block that needs the
    entry-by-entry parser (a bytes field) beside vectorised ones, and an empty footer."""
    monkeypatch.setattr(array_record_remote, "ENTRY_BLOCK", 64)
    rng = np.random.default_rng(2)
    offs = np.cumsum(rng.integers(1, 2**20, 300)).tolist()
    entries = [_varint(8) + _varint(o) + _varint(24) + _varint(int(c)) for o, c in zip(offs, rng.integers(1, 9, 300))]
    entries[130] += _varint(2 << 3 | 2) + _varint(3) + b"abc"
    sizes = np.array([len(e) for e in entries])
    begins, counts = index_entries(b"".join(entries), sizes)
    slow = [_proto_fields(e) for e in entries]
    assert begins.tolist() == [f.get(1, 0) for f in slow] == offs
    assert counts.tolist() == [f.get(3, 0) for f in slow]
    assert [a.tolist() for a in index_entries(b"", np.zeros(0, np.int64))] == [[], []]


@pytest.mark.parametrize("options", ["group_size:1", "group_size:7", "group_size:1,uncompressed",
                                     "group_size:5,snappy", "group_size:3,brotli"])
def test_ranged_reader_decodes_every_writer_layout(tmp_path, options):
    rng = np.random.default_rng(2)
    records = [rng.integers(0, 50_000, int(rng.integers(0, 300)), dtype=np.int32).tobytes()
               for _ in range(2500)]  # several 64 KiB blocks: chunks cross block headers
    path = tmp_path / "r.array_record"
    write_array_record(path, records, options)
    reader = RangedArrayRecord(open_blob(str(path)))
    assert reader.num_records() == len(records)
    idx = rng.integers(0, len(records), 400)
    assert reader.read(idx.tolist()) == [records[i] for i in idx]
    begin, end = int(reader.chunk_begin[0]), int(reader.chunk_end[0])
    raw = path.read_bytes()[begin:end]
    logical = bytearray(strip_block_headers(raw, begin))
    logical[32] ^= 1  # the decoded size in the chunk header no longer matches the records
    with pytest.raises(ValueError, match="chunk header says"):
        chunk_values(bytes(logical))


@pytest.mark.parametrize("options", ["group_size:1", "group_size:7", "group_size:1,uncompressed",
                                     "group_size:5,snappy"])
def test_whole_runs_of_chunks_decode_as_the_records(tmp_path, options):
    """The block shuffle's read: a run of consecutive chunks fetched as one range and decoded
    together (numpy-parsed headers for one-record chunks, chunk by chunk otherwise)."""
    from zephon.sources.array_record_remote import read_runs

    rng = np.random.default_rng(3)
    records = [rng.integers(0, 50_000, int(rng.integers(0, 400)), dtype=np.int32).tobytes()
               for _ in range(3000)]
    path = tmp_path / "r.array_record"
    write_array_record(path, records, options)
    reader = RangedArrayRecord(open_blob(str(path)))
    spans = [(0, 1), (0, 3000), (17, 940), (2999, 3000), (1500, 1501)]
    got = read_runs([reader] * len(spans), spans)
    assert got == [records[a:b] for a, b in spans]
    # tiny chunks (1 KiB records that compress to a few bytes): some begin exactly at a 64 KiB
    # block boundary, their bytes after its header
    same = [np.full(256, i, np.int32).tobytes() for i in range(20_000)]
    write_array_record(tmp_path / "s.array_record", same, options)
    reader = RangedArrayRecord(open_blob(str(tmp_path / "s.array_record")))
    spans = [(i * 350, min(20_000, (i + 1) * 350)) for i in range(58)]
    assert read_runs([reader] * len(spans), spans) == [same[a:b] for a, b in spans]

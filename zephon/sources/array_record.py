"""ArrayRecord files (one file, a shard set, or a glob) as one random-access source.

Global record `i` lives in the shard whose cumulative count first exceeds `i`. A read sends one
`ArrayRecordReader.read(local_indices)` per shard touched (the C++ reader fetches them in
parallel), then scatters the records back to request order and decodes them all at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import SourceError
from ..storage import Blob
from .array_record_remote import pin, ranged_reader, read_records, read_runs
from .base import Columns, as_indices
from .blocks import BlockCache, BlockStats, natural_block
from .files import FileStamp, changed, check_unchanged, stamp
from .handles import FileHandles
from .parallel import map_files
from .paths import Paths, expand_paths, shard_name
from .spec import RawBytes, RecordSpec

log = logging.getLogger(__name__)

# Grain's settings for random access: no readahead (reads are scattered), a small file buffer.
# The reader's own thread pool stays on, which is what makes `read(indices)` parallel.
RANDOM_ACCESS_OPTIONS = "readahead_buffer_size:0"
_FILE_READER_BUFFER_SIZE = 32768
WRITER_OPTIONS = "group_size:1"


# The C++ reader works on a process-wide thread pool. `os.fork()` copies that pool into the
# child without its threads, and with any lock one of them held at that instant. Measured with a
# thread reading while the parent forks: a child's reads blocked forever in a futex in 2 of 60
# forks, in the reader's constructor (a new reader of the child's own) — and still 1 in 60 with
# every read quiesced across the fork and the child's readers kept off the pool
# (`max_parallelism:0`). Nothing a child can do is safe, so a process forked from one that opened
# ArrayRecord readers refuses to read, saying how to start workers instead.
_state = {"opened": False, "forked": False}


def _after_fork_in_child() -> None:
    if _state["opened"]:
        _state["forked"] = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def readers_opened() -> bool:
    """Whether this process opened ArrayRecord readers (so its forked children must not read:
    start workers with 'forkserver' or 'spawn')."""
    return _state["opened"]


def _refuse_after_fork(path: str) -> None:
    if _state["forked"]:
        raise SourceError(
            f"cannot read {path} in a process forked (os.fork) from one that had opened ArrayRecord "
            "readers: the reader's thread pool and its locks do not survive a fork, and a read here "
            "can block forever. Start worker processes with 'forkserver' or 'spawn' instead: "
            "torch DataLoader(..., multiprocessing_context='forkserver'), "
            "multiprocessing.set_start_method('forkserver'); zephon.runners.processes() uses "
            "forkserver by default.")


def _module() -> Any:
    from array_record.python import array_record_module

    return array_record_module


def _open_reader(path: str, options: str, blob: Blob | None = None) -> Any:
    """Opens a reader, turning the reader's silent failure mode into an error.

    An object in a bucket (`blob`) is read by byte ranges through `zephon.storage` instead
    (array_record_remote.py): ArrayRecord's reader reads no s3:// and may hang on gs://.

    ArrayRecordReader never raises on open: on a missing, truncated or corrupt file it returns
    a reader with `ok() == False` and `num_records() == 0`, and some such readers then return
    empty records instead of raising. The sequential `read()` is the one call that reports the
    reader's status message, so it supplies the reason.
    """
    _refuse_after_fork(path)
    _state["opened"] = True
    if blob is not None:
        return ranged_reader(blob)
    reader = _module().ArrayRecordReader(path, options,
                                         file_reader_buffer_size=_FILE_READER_BUFFER_SIZE)
    if reader.ok():
        return reader
    try:
        reader.read()
        reason = "unknown reason"
    except Exception as e:  # the status message is all the reader offers
        reason = str(e) or "no reason given by the reader"
    with contextlib.suppress(RuntimeError):  # close() re-raises the same status
        reader.close()
    raise SourceError(f"ArrayRecord file {path!r} cannot be opened: {reason}. It is truncated, "
                      "corrupt or not an ArrayRecord file; rewrite it (or restore it from the "
                      "original) before reading.")


def _count_records(path: str, options: str, blob: Blob | None = None) -> int:
    reader = _open_reader(path, options, blob)
    try:
        return int(reader.num_records())
    finally:
        reader.close()


def _warn_group_size(path: str, reader: Any) -> None:
    """Warns when a file's records are compressed in groups (checked when a file is first read,
    not at construction: on many shards start-up then opens each file for its count only)."""
    group = re.search(r"group_size:(\d+)", reader.writer_options_string() or "")
    if group and group[1] != "1":
        log.warning("%s was written with group_size:%s; every random read decompresses a group "
                    "of records. Rewrite it with group_size:1 for fast shuffled reads.",
                    path, group[1])


class ArrayRecordSource(FileHandles):
    """Random-access records from ArrayRecord files, decoded by `spec`.

    Readers are opened lazily and are never pickled, so the source can be shipped to worker
    processes started with 'forkserver' or 'spawn' as is. A process forked from one that opened
    readers refuses to read (a `SourceError` saying so): the C++ reader can block forever there.

    Each shard's identity (inode, size, mtime) is recorded here and checked after every read and
    on every read error: ArrayRecord's reader returns empty records from a file rewritten under
    it, so a changed file is a `SourceError` naming it, never silently wrong records.
    """

    _transient = ("_readers", "_lock", "_pid", "_blocks")

    def __init__(self, paths: Paths, spec: RecordSpec | None = None,
                 reader_options: str = RANDOM_ACCESS_OPTIONS) -> None:
        self.paths = expand_paths(paths, "ArrayRecordSource")
        self._stamps: list[FileStamp] = [stamp(p, "ArrayRecordSource") for p in self.paths]
        self.spec: RecordSpec = spec if spec is not None else RawBytes()
        self.reader_options = reader_options
        # The only per-file work before the first read: each file's footer, for its count, on a
        # few threads; readers for reading open lazily, for the shards a read touches. Objects
        # are pinned here: every process this source is shipped to reads this version.
        self._blobs = map_files(pin, self.paths)
        blobs = dict(zip(self.paths, self._blobs))
        counts = np.array(map_files(lambda p: _count_records(p, reader_options, blobs[p]), self.paths),
                          dtype=np.int64)
        self._ends = np.cumsum(counts)
        self._starts = self._ends - counts
        self._reset()
        log.debug("%r: %d records in %d files", self, len(self), len(self.paths))
        self._what = repr(self)  # as_indices names the source; repr is too slow per read

    def _reset(self) -> None:
        self._readers: list[Any] = [None] * len(self.paths)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        follow = getattr(self, "_follow", None)
        self._blocks = None if follow is None else BlockCache(*follow)

    def natural_block(self) -> int:
        """Records of one ranged GET under a block shuffle: a run of whole chunks of about
        `BLOCK_TARGET_BYTES` on disk (one record a chunk in the files Zephon writes)."""
        sizes = [b.size if b is not None else os.path.getsize(p) for p, b in zip(self.paths, self._blobs)]
        unit = 1
        for blob in self._blobs[:1]:
            if blob is not None:
                unit = max(1, int(np.median(np.diff(ranged_reader(blob).chunk_first))))
        return natural_block(sum(sizes), len(self), unit)

    def follow_blocks(self, block: int, capacity: int) -> None:
        """Reads of objects fetch blocks of `block` records whole and keep up to `capacity` of
        them (`zephon.sources.blocks`); local files are read as before (no round trips)."""
        if all(b is None for b in self._blobs):
            return
        self._follow = (int(block), int(capacity))
        self._blocks = BlockCache(*self._follow)

    def block_stats(self) -> BlockStats | None:
        """What the block cache did in this process (None when not following blocks)."""
        return None if self._blocks is None else self._blocks.stats()

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __repr__(self) -> str:
        return f"ArrayRecordSource({self._head()}, spec={self.spec!r})"

    def _reader(self, shard: int) -> Any:
        if self._pid != os.getpid():  # forked: the parent's readers are not ours to share
            _refuse_after_fork(self.paths[shard])
            self._reset()
        reader = self._readers[shard]
        if reader is None:
            with self._lock:
                reader = self._readers[shard]
                if reader is None:
                    err = changed(self.paths[shard], self._stamps[shard], "ArrayRecordSource")
                    if err is not None:
                        raise err
                    reader = _open_reader(self.paths[shard], self.reader_options,
                                          self._blobs[shard])
                    _warn_group_size(self.paths[shard], reader)
                    self._readers[shard] = reader
        return reader

    def read(self, indices: np.ndarray) -> Columns:
        idx = as_indices(indices, len(self), self._what)
        shard = np.searchsorted(self._ends, idx, side="right")
        local = idx - self._starts[shard]
        order = np.argsort(shard, kind="stable")
        cuts = np.flatnonzero(np.diff(shard[order])) + 1
        records = np.empty(len(idx), dtype=object)
        groups = [(int(shard[p[0]]), p) for p in np.split(order, cuts)] if idx.size else []
        touched = [s for s, _ in groups]
        ranged = [(s, p) for s, p in groups if self._blobs[s] is not None]
        blocks = self._blocks if self._pid == os.getpid() else None
        if blocks is not None and len(ranged) == len(groups) and idx.size:
            try:
                records = blocks.gather(idx, self._fetch_blocks)
                groups = []
            except RuntimeError as e:  # a damaged chunk: read record by record below, which names it
                log.warning("%s: a whole-block read failed (%s); reading these records one chunk "
                            "at a time", self._what, e)
        got = self._read_ranged(ranged, local) if ranged and groups else {}
        for s, positions in groups:
            recs = got[s] if s in got else self._read_shard(s, local[positions], idx[positions])
            records[positions] = np.fromiter(recs, dtype=object, count=len(positions))
        # Once per read, after it: the records above come from the files the source opened.
        check_unchanged(self.paths, self._stamps, touched, "ArrayRecordSource")

        def locate(i: int) -> str:
            return (f"{self.paths[int(shard[i])]}: record {int(idx[i])} (record {int(local[i])} "
                    f"of shard {int(shard[i])})")

        return self.spec.decode(records, locate)

    def _fetch_blocks(self, blocks: list[int]) -> list[tuple[np.ndarray, int]]:
        """The records of whole blocks (every shard's chunks requested together)."""
        b, n = self._blocks.block, len(self)  # type: ignore[union-attr]
        pieces: list[tuple[int, int, int, int]] = []  # (block, shard, first, end) in shard records
        for k in blocks:
            lo, hi = k * b, min(n, (k + 1) * b)
            for s in range(int(np.searchsorted(self._ends, lo, side="right")),
                           int(np.searchsorted(self._ends, hi - 1, side="right")) + 1):
                start = int(self._starts[s])
                pieces.append((k, s, max(lo, start) - start, min(hi, int(self._ends[s])) - start))
        got = read_runs([self._reader(s) for _, s, _, _ in pieces], [(a, e) for _, _, a, e in pieces])
        parts: dict[int, list[bytes]] = {}
        for (k, _, _, _), recs in zip(pieces, got):
            parts.setdefault(k, []).extend(recs)
        out = []
        for k in blocks:
            recs = parts[k]
            arr = np.empty(len(recs), dtype=object)
            arr[:] = recs
            out.append((arr, sum(map(len, recs))))
        return out

    def _read_ranged(self, groups: list[tuple[int, np.ndarray]], local: np.ndarray) -> dict[int, list[bytes]]:
        """Records of objects in a bucket: every shard's chunks requested together. On a damaged
        chunk, nothing: the shards are then read one by one, which names the record."""
        readers = [self._reader(s) for s, _ in groups]
        try:
            got = read_records(readers, [local[p] for _, p in groups])
        except RuntimeError:
            return {}
        return {s: recs for (s, _), recs in zip(groups, got)}

    def _read_shard(self, shard: int, local: np.ndarray, global_idx: np.ndarray) -> list[bytes]:
        reader = self._reader(shard)
        try:
            return reader.read(local.tolist())
        except RuntimeError as e:
            err = changed(self.paths[shard], self._stamps[shard], "ArrayRecordSource")
            if err is not None:  # not corrupt: rewritten under us
                raise err from e
            failed = self._first_failing(reader, local, global_idx)
            raise SourceError(f"{self.paths[shard]}: reading {failed} failed: {e}. The file is "
                              "corrupt; rewrite it (or restore it from the original).") from e

    @staticmethod
    def _first_failing(reader: Any, local: np.ndarray, global_idx: np.ndarray) -> str:
        """Pins a failed batch read on one record, so the error names it (error path only)."""
        for g, l in zip(global_idx.tolist(), local.tolist()):
            try:
                reader.read([l])
            except RuntimeError:
                return f"record {g} (record {l} of this shard)"
        return f"records {global_idx[:8].tolist()}{' ...' if len(global_idx) > 8 else ''}"


def write_array_record(path: str | os.PathLike[str], records: Iterable[bytes],
                       options: str = WRITER_OPTIONS) -> int:
    """Writes one ArrayRecord file (group_size:1, for random access); returns the record count."""
    path = os.fspath(path)
    writer = _module().ArrayRecordWriter(path, options)
    if not writer.ok():
        raise SourceError(f"cannot create ArrayRecord file {path!r}; check that its directory "
                          "exists and is writable.")
    count = 0
    try:
        for record in records:
            writer.write(record)
            count += 1
    finally:
        writer.close()
    return count


def write_sharded_array_record(prefix: str | os.PathLike[str], records: Iterable[bytes],
                               num_shards: int, options: str = WRITER_OPTIONS) -> list[str]:
    """Splits `records` into `num_shards` contiguous blocks named `prefix-0000i-of-0000N`.

    Contiguous blocks keep global record `i` equal to the `i`-th record written, which is what
    `ArrayRecordSource(prefix + '@N')` numbers. Returns the shard paths.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    items: Sequence[bytes] = records if isinstance(records, Sequence) else list(records)
    bounds = np.arange(num_shards + 1) * len(items) // num_shards
    paths = [shard_name(os.fspath(prefix), i, num_shards) for i in range(num_shards)]
    for path, start, stop in zip(paths, bounds[:-1], bounds[1:]):
        write_array_record(path, items[start:stop], options)
    return paths

"""Parquet files as a random-access source.

Parquet's unit of decoding is the row group, so a read decodes each row group it touches once
and gathers the requested rows from it; a small LRU keeps recently decoded groups, which is what
makes a shuffle over a window of nearby groups cheap. Construction reads footers only.

Under a global shuffle a read of a few records touches as many row groups, so the loader reads a
whole window of batches at once (its read-ahead): every row group the window touches is decoded
once, on a few threads (pyarrow decodes without the GIL), and the rows are gathered back into
the window's order. The emitted order never depends on this grouping.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import DecodeError, SourceError
from ..storage import read_blobs
from ..storage.file import Spans
from .array_record_remote import pin
from .base import Columns, as_indices
from .files import FileStamp, changed, check_unchanged, stamp
from .handles import MAX_OPEN_FILES, FileHandles, OpenFiles, open_error
from .parallel import map_files
from .parquet_remote import open_ranged_parquet
from .paths import Paths, expand_paths

log = logging.getLogger(__name__)
REMOTE_READERS, REMOTE_AHEAD_BYTES = 16, 256 << 20  # objects: row-group reads in flight, their bytes
#: a block-shuffled read's column chunks fetched ahead: gap bytes allowed, as a share of the asked
FETCH_AHEAD_OVERFETCH = 0.1


class ParquetSource(FileHandles):
    """Rows of Parquet files (concatenated in order) as columns.

    Conversion depends on the schema only, never on the values a read happens to touch, so a
    column has the same dtype and shape whichever rows (and so whichever rank) reads it:
    numbers -> 1-D arrays; fixed-size lists -> N-D arrays; strings/binary -> object arrays;
    variable lists -> object arrays of 1-D arrays, or 2-D arrays for the columns named in
    `list_lengths` (each row must then have exactly that length); structs -> one column per
    field, named "struct/field". All files must share one schema for the selected columns.

    `decode_threads` (default: up to 4, at most the CPUs available) decode the row groups of one
    read in parallel; 1 decodes them in the calling thread. Objects are read by up to 16 threads
    (fewer if two row groups each would pass 256 MiB): more round trips in flight hide latency.

    Integrity: page checksums (CRC32, written by `write_parquet` and by any writer with
    `write_page_checksum=True`) are verified on every read, so a flipped bit in a data or
    dictionary page is a `SourceError` naming the file and row group (`verify_checksums=False`
    skips that, for storage you trust; it cost ~3% of decode time when measured).
    Files written without checksums cannot be verified: most damage there reads as wrong values.
    Files are read, never memory-mapped (a mapped file truncated by another process kills the
    reader with SIGBUS), and each file's identity (inode, size, mtime) is checked after every read: a file rewritten
    under a running job is a `SourceError`, never rows mixed from two versions.
    """

    _transient = ("_handles", "_cache", "_cache_lock", "_pool", "_pid", "_spans")

    def __init__(self, paths: Paths, columns: Sequence[str] | None = None, *,
                 list_lengths: Mapping[str, int] | None = None, cache_row_groups: int = 4,
                 decode_threads: int | None = None, verify_checksums: bool = True,
                 max_open_files: int = MAX_OPEN_FILES) -> None:
        self.paths = expand_paths(paths, "ParquetSource")
        self.verify_checksums = bool(verify_checksums)
        self._stamps: list[FileStamp] = [stamp(p, "ParquetSource") for p in self.paths]
        self._blobs = map_files(pin, self.paths)  # objects: version pinned for every process
        self.list_lengths = dict(list_lengths or {})
        self.cache_row_groups = cache_row_groups
        self.fetch_ahead = False  # follow_blocks: a read's column chunks fetched in one round
        self.decode_threads = decode_threads if decode_threads is not None else min(4, _cores())
        self.max_open_files = max_open_files
        # Footers only, on a few threads; no file stays open (reads reopen a file from its kept
        # footer, which costs no second footer read), so start-up holds no descriptors.
        blobs = dict(zip(self.paths, self._blobs))

        def footer(path: str) -> Any:
            blob = blobs[path]  # objects: by ranges
            return self._footer(path) if blob is None else \
                open_ranged_parquet(blob, self.verify_checksums).metadata

        self._meta: list[Any] = map_files(footer, self.paths)
        first = self._meta[0]
        schema = first.schema.to_arrow_schema()
        self.columns = list(columns) if columns is not None else list(schema.names)
        for path, meta in zip(self.paths, self._meta):
            if meta is not first and _same_schema(meta, first):
                continue  # the common case on many shards: no Arrow schema built per file
            file_schema = meta.schema.to_arrow_schema()
            for name in self.columns:
                if file_schema.get_field_index(name) < 0:
                    raise SourceError(f"{path}: has no column {name!r} (it has "
                                      f"{file_schema.names}); fix `columns` or the file.")
                if not file_schema.field(name).type.equals(schema.field(name).type):
                    raise SourceError(
                        f"{path}: column {name!r} is {file_schema.field(name).type} but in "
                        f"{self.paths[0]} it is {schema.field(name).type}; every file must share "
                        "one schema so a column's dtype does not depend on which file a row is in.")
        unknown = sorted(set(self.list_lengths) - set(self.columns))
        if unknown:
            raise ValueError(f"ParquetSource: list_lengths names {unknown}, which are not among "
                             f"the selected columns {self.columns}")
        self._schema = schema
        groups_meta = [(fi, g, m.row_group(g)) for fi, m in enumerate(self._meta) for g in range(m.num_row_groups)]
        meta = [(fi, g, rg.num_rows) for fi, g, rg in groups_meta]
        self._threads = self.decode_threads  # objects: reads wait on round trips, so more run at once
        if self.decode_threads > 1 and any(b is not None for b in self._blobs):  # (2 groups a thread)
            biggest = max(max((rg.total_byte_size for _, _, rg in groups_meta), default=1), 1)
            self._threads = max(self.decode_threads, min(REMOTE_READERS, REMOTE_AHEAD_BYTES // (2 * biggest)))
        self._group_file = np.array([m[0] for m in meta], dtype=np.int64)
        self._group_local = np.array([m[1] for m in meta], dtype=np.int64)
        rows = np.array([m[2] for m in meta], dtype=np.int64)
        self._group_ends = np.cumsum(rows)
        self._group_starts = self._group_ends - rows
        self._reset()
        log.debug("%r: %d rows in %d row groups", self, len(self), len(rows))
        self._what = repr(self)  # as_indices names the source; repr is too slow per read

    @staticmethod
    def _footer(path: str) -> Any:
        """One file's footer (`FileMetaData`), read through a descriptor that is closed again."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            with pa.OSFile(path) as f:  # no filesystem resolution per file: ~1/3 faster
                return pq.ParquetFile(f).metadata
        except (OSError, pa.ArrowException, ValueError) as e:
            _raise_if_emfile(path, e)
            raise SourceError(f"Parquet file {path!r} cannot be opened: {e}. It is truncated, "
                              "corrupt or not Parquet; rewrite it before reading.") from e

    @staticmethod
    def _open(path: str, verify: bool = True, metadata: Any = None) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            # Not memory-mapped: a mapped file that another process truncates raises SIGBUS,
            # which kills the training process; reads through the file descriptor fail cleanly.
            return pq.ParquetFile(path, memory_map=False, page_checksum_verification=verify,
                                  metadata=metadata)
        except (OSError, pa.ArrowException, ValueError) as e:  # ValueError: a damaged footer's
            # column names are not UTF-8
            _raise_if_emfile(path, e)
            raise SourceError(f"Parquet file {path!r} cannot be opened: {e}. It is truncated, "
                              "corrupt or not Parquet; rewrite it before reading.") from e

    def _reset(self) -> None:
        # A ParquetFile is not safe to read from two threads, so each thread opens its own
        # (from its kept footer); at most max_open_files of them stay open.
        self._handles = OpenFiles(self.max_open_files, lambda f: f.close())
        self._cache: OrderedDict[int, Columns] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._spans = [Spans() for _ in self.paths]  # column chunks fetched ahead (block shuffle)

    def _decoder_pool(self) -> ThreadPoolExecutor | None:
        if self.decode_threads < 2:
            return None
        with self._cache_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="zephon-parquet")
            return self._pool

    def _opened(self, index: int) -> Any:
        err = changed(self.paths[index], self._stamps[index], "ParquetSource")
        if err is not None:  # never read the footer of another version of the file
            raise err
        blob = self._blobs[index]
        return self._open(self.paths[index], self.verify_checksums, self._meta[index]) \
            if blob is None else open_ranged_parquet(blob, self.verify_checksums, self._meta[index],
                                                     self._spans[index])

    def __len__(self) -> int:
        return int(self._group_ends[-1]) if len(self._group_ends) else 0

    def natural_block(self) -> int:
        """The rows of a row group (the largest, when they differ): a block shuffle's unit,
        read as one ranged GET per column chunk. Blocks align with row groups when every row
        group but each file's last has this many rows (as `write_parquet` and most writers do)."""
        return int(np.max(self._group_ends - self._group_starts))

    def follow_blocks(self, block: int, capacity: int) -> None:
        """Under a block shuffle: keep the decoded row groups of `capacity` blocks of `block`
        rows (about two windows' worth), so each row group is fetched and decoded once a window."""
        per = int(np.max(self._group_ends - self._group_starts))
        self.cache_row_groups = max(self.cache_row_groups, int(capacity) * (-(-int(block) // per) + 1))
        self.fetch_ahead = True

    def _fetch_ahead(self, groups: list[int]) -> None:
        """The column chunks of the uncached row groups among `groups` of objects, fetched in one
        round (neighbours merged into few requests) before pyarrow asks for them one by one."""
        with self._cache_lock:
            todo = [g for g in groups if g not in self._cache]
        if len(todo) < 2:
            return
        wanted: dict[int, list[tuple[int, int]]] = {}
        for g in todo:
            file = int(self._group_file[g])
            if self._blobs[file] is None:
                continue
            rg = self._meta[file].row_group(int(self._group_local[g]))
            for j in range(rg.num_columns):
                cc = rg.column(j)
                if cc.path_in_schema.split(".")[0] not in self.columns:
                    continue
                start = cc.data_page_offset
                if cc.has_dictionary_page and cc.dictionary_page_offset is not None and cc.dictionary_page_offset > 0:
                    start = min(start, cc.dictionary_page_offset)
                wanted.setdefault(file, []).append((int(start), int(cc.total_compressed_size)))
        if not wanted:
            return
        files = list(wanted)
        # neighbouring chunks share a request across the other columns' chunks between them while
        # those gaps stay within 10 % of the bytes asked (fetched <= 1.1x needed, few requests)
        items = [(self._blobs[f], wanted[f]) for f in files]
        got = read_blobs(items, overfetch=FETCH_AHEAD_OVERFETCH)  # type: ignore[arg-type]
        for f, datas in zip(files, got):
            self._spans[f].add(wanted[f], datas)

    def block_stats(self) -> dict[str, int]:
        """Row groups held decoded now, and the most the cache may hold."""
        with self._cache_lock:
            held = list(self._cache.values())
        return {"capacity_groups": self.cache_row_groups, "held_groups": len(held),
                "held_bytes": sum(int(sum(_nbytes(v) for v in cols.values())) for cols in held)}

    def __repr__(self) -> str:
        return f"ParquetSource({self._head()}, columns={self.columns})"

    def read(self, indices: np.ndarray) -> Columns:
        idx = as_indices(indices, len(self), self._what)
        if idx.size == 0:
            return self._convert(self._schema.empty_table().select(self.columns), lambda i: "")
        group = np.searchsorted(self._group_ends, idx, side="right")
        row = idx - self._group_starts[group]
        order = np.argsort(group, kind="stable")
        cuts = np.flatnonzero(np.diff(group[order])) + 1
        positions = np.split(order, cuts)
        groups = [int(group[pos[0]]) for pos in positions]
        if self._pid != os.getpid():  # forked: open our own files, start a fresh cache and pool
            self._reset()
        out: Columns = {}
        if self.fetch_ahead:
            self._fetch_ahead(groups)
        for pos, decoded in zip(positions, self._decode_all(groups)):
            # Gather each group's rows as soon as it is decoded and let it go: a window under a
            # global shuffle touches every row group, and holding them all would cost the file.
            for name, values in decoded.items():
                if name not in out:
                    out[name] = np.empty((len(idx), *values.shape[1:]), dtype=values.dtype)
                out[name][pos] = values[row[pos]]
        if self.fetch_ahead:
            for spans in self._spans:  # the column chunks fetched ahead are decoded and cached
                spans.clear()
        # Once per read: the rows above come from the files as they were when the source opened.
        check_unchanged(self.paths, self._stamps,
                        np.unique(self._group_file[groups]).tolist(), "ParquetSource")
        return out

    def _decode_all(self, groups: list[int]) -> Iterator[Columns]:
        """Decoded row groups in order, at most two per decode thread alive at once."""
        pool = self._decoder_pool() if len(groups) > 1 else None
        if pool is None:
            yield from map(self._row_group, groups)
            return
        ahead = 2 * self._threads
        pending = deque(pool.submit(self._row_group, g) for g in groups[:ahead])
        rest = iter(groups[ahead:])
        try:
            while pending:
                decoded = pending.popleft().result()
                nxt = next(rest, None)
                if nxt is not None:
                    pending.append(pool.submit(self._row_group, nxt))
                yield decoded
        finally:
            for fut in pending:
                fut.cancel()

    def _row_group(self, group: int) -> Columns:
        with self._cache_lock:
            if group in self._cache:
                self._cache.move_to_end(group)
                return self._cache[group]
        import pyarrow as pa

        file, local = int(self._group_file[group]), int(self._group_local[group])
        path, first = self.paths[file], int(self._group_starts[group])
        try:
            with self._handles.use((threading.get_ident(), file), lambda: self._opened(file)) as pf:
                table = pf.read_row_group(local, columns=self.columns, use_threads=False)
        except (OSError, pa.ArrowException) as e:
            if isinstance(e, SourceError):  # the storage layer's own error names the object
                raise
            err = changed(path, self._stamps[file], "ParquetSource")
            if err is not None:  # not corrupt: rewritten under us
                raise err from e
            raise SourceError(f"{path}: row group {local} (records {first}.."
                              f"{int(self._group_ends[group]) - 1}) cannot be read: "
                              f"{str(e).strip().rstrip('.')}. The file is corrupt or truncated "
                              "(a failed page checksum means bits changed on disk or in "
                              "transfer); rewrite it, or restore it from the original.") from e
        try:
            decoded = self._convert(table, lambda i: f"{path}: record {first + i} (row {i} of "
                                                     f"row group {local})")
        except DecodeError as e:
            err = changed(path, self._stamps[file], "ParquetSource")
            if err is not None:  # not bad data: rewritten under us
                raise err from e
            raise
        with self._cache_lock:
            self._cache[group] = decoded
            while len(self._cache) > self.cache_row_groups:
                self._cache.popitem(last=False)
        return decoded

    def _convert(self, table: Any, locate: Callable[[int], str]) -> Columns:
        import pyarrow as pa

        out: Columns = {}
        for name, column in zip(table.column_names, table.columns):
            arr = column.combine_chunks()
            try:
                convert_array(name, arr, self.list_lengths.get(name), locate, out)
            except pa.ArrowException as e:  # e.g. text that is not UTF-8 in a file without checksums
                raise DecodeError(f"{_bad_row(name, arr, locate)}: column {name!r} cannot be decoded "
                                  f"({str(e).strip()}); the file holds damaged or mistyped data. "
                                  "Rewrite it (write_parquet adds page checksums), or leave the "
                                  "column out with `columns=`.") from e
        return out

def _nbytes(values: np.ndarray) -> int:
    if values.dtype == object:  # strings / bytes / ragged lists: their payloads, roughly
        return int(values.nbytes) + sum(len(v) if hasattr(v, "__len__") else 8 for v in values)
    return int(values.nbytes)


def _same_schema(a: Any, b: Any) -> bool:
    """Whether two footers give the same Arrow schema: the same Parquet schema and the same
    stored Arrow schema (which decides e.g. string vs large_string)."""
    if not a.schema.equals(b.schema):
        return False
    key = b"ARROW:schema"
    return bool((a.metadata or {}).get(key) == (b.metadata or {}).get(key))


def _raise_if_emfile(path: str, e: Exception) -> None:
    """Too many open files is named for what it is, not as a corrupt file."""
    if "Too many open files" in str(e) or getattr(e, "errno", None) in (errno.EMFILE, errno.ENFILE):
        raise open_error(path, OSError(errno.EMFILE, str(e)), "ParquetSource") from e


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def convert_array(name: str, arr: Any, list_length: int | None, locate: Callable[[int], str],
                  out: Columns) -> None:
    """Adds Arrow array `arr` (column `name`) to `out` as numpy columns: structs as `name/field`
    columns, strings and bytes as objects, lists as ragged or `list_length`-wide arrays (the
    Parquet and Hugging Face Arrow sources share it)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.dictionary_decode(), t.value_type
    if pa.types.is_struct(t):
        _require_no_nulls(name, arr, locate)
        for field, child in zip(t, arr.flatten()):
            convert_array(f"{name}/{field.name}", child, None, locate, out)
        return
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
            or pa.types.is_large_binary(t):
        out[name] = arr.to_numpy(zero_copy_only=False)  # object array; a null is None
        return
    _require_no_nulls(name, arr, locate)
    if pa.types.is_fixed_size_list(t):
        values = _values(name, arr, locate)
        out[name] = values.reshape((len(arr), t.list_size, *values.shape[1:]))
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        values = _values(name, arr, locate)
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        if list_length is not None:
            bad = np.flatnonzero(lengths != list_length)
            if bad.size:
                raise DecodeError(f"{locate(int(bad[0]))}: column {name!r} has {lengths[bad[0]]} "
                                  f"items but list_lengths says {list_length}; fix list_lengths or "
                                  "drop it to get the rows as an object array.")
            out[name] = values.reshape((len(arr), list_length, *values.shape[1:]))
        else:
            out[name] = np.fromiter(np.split(values, np.cumsum(lengths)[:-1]), dtype=object,
                                    count=len(arr)) if len(arr) else np.empty(0, dtype=object)
    else:
        out[name] = arr.to_numpy(zero_copy_only=False)


def _bad_row(name: str, arr: Any, locate: Callable[[int], str]) -> str:
    """Where the first row of `arr` that does not convert is (error path only: row by row)."""
    import pyarrow as pa

    for i in range(len(arr)):
        try:
            convert_array(name, arr.slice(i, 1), None, locate, {})
        except pa.ArrowException:
            return locate(i)
        except DecodeError:
            continue
    return locate(0).split(": record")[0]


def _values(name: str, arr: Any, locate: Callable[[int], str]) -> np.ndarray:
    """A list array's items (respecting slicing), converted with the same rules."""
    inner: Columns = {}
    convert_array(name, arr.flatten(), None, locate, inner)
    return inner[name]


def _require_no_nulls(name: str, arr: Any, locate: Callable[[int], str]) -> None:
    """Nulls are refused rather than filled: filling would change a numeric column's dtype."""
    if arr.null_count:
        first = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise DecodeError(f"{locate(first)}: column {name!r} is null. Fill nulls when writing the "
                          "file, or leave the column out with `columns=`.")


def write_parquet(path: str | os.PathLike[str], columns: Mapping[str, np.ndarray],
                  row_group_size: int) -> None:
    """Writes equal-length arrays as one Parquet file; N-D numeric arrays become fixed-size lists
    (so they read back N-D), object arrays become strings, binary or variable lists.

    Every page carries a CRC32 checksum (`write_page_checksum`), which `ParquetSource` verifies,
    so damage on disk or in transfer is an error instead of wrong data.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {k: np.asarray(v) for k, v in columns.items()}
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"write_parquet: columns have different lengths {lengths}")
    table = {}
    for name, value in arrays.items():
        try:
            if value.dtype == object:
                table[name] = pa.array(list(value))
                continue
            arrow = pa.array(value.reshape(-1))
            for size in reversed(value.shape[1:]):
                arrow = pa.FixedSizeListArray.from_arrays(arrow, size)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise ValueError(f"write_parquet {os.fspath(path)!r}: column {name!r} ({value.dtype}, "
                             f"shape {value.shape}) cannot be stored in Parquet: {e}. Give it one "
                             "type: numbers, str, bytes, or lists of numbers.") from None
        table[name] = arrow
    pq.write_table(pa.table(table), os.fspath(path), row_group_size=row_group_size,
                   write_page_checksum=True)

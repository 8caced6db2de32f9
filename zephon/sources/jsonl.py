"""JSON Lines files as a random-access source.

Construction scans each file once for newlines (numpy over fixed-size chunks, so memory stays
bounded) and keeps each record's byte span; a read fetches only the requested lines.

JSON has no schema, so the source fixes one at construction — given as `schema=`, or inferred
from the first lines — and holds every line it reads to it: a field whose type drifts (an int in
one line, a string in another), a missing field or an unknown one is a `DecodeError` naming the
file, the line and the field. That is what keeps a column's dtype independent of which lines a
read touched, and so of the number of ranks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ..errors import DecodeError, SourceError
from ..plan.jsondoc import loads
from ..storage import is_remote, open_blob
from .array_record_remote import pin
from .base import Columns, as_indices
from .columns import flatten, objects, stack
from .files import FileStamp, changed, check_unchanged, stamp
from .handles import MAX_OPEN_FILES, FileHandles, OpenFiles, open_error
from .jsonl_remote import head as remote_head
from .jsonl_remote import remote_line_spans
from .jsonl_schema import KINDS, checker, hint, kind_of, merge, short, validate_schema
from .parallel import map_files
from .paths import Paths, expand_paths

__all__ = ["INFER_RECORDS", "KINDS", "JsonlSource"]

log = logging.getLogger(__name__)

_SCAN_CHUNK = 16 << 20

#: Lines the schema is inferred from when none is given.
INFER_RECORDS = 100


def _line_spans(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte [start, end) of every non-empty line; empty lines (blank separators, the newline at
    end of file) are not records. A trailing '\\r' is left to json.loads, which ignores it."""
    newlines = []
    offset = 0
    with open(path, "rb") as f:
        # sized to the file: a small file must not cost a 16 MB buffer (10,000 shards would)
        buf = bytearray(max(1, min(_SCAN_CHUNK, os.fstat(f.fileno()).st_size + 1)))
        while n := f.readinto(buf):
            chunk = np.frombuffer(buf, dtype=np.uint8, count=n)
            newlines.append(np.flatnonzero(chunk == ord("\n")) + offset)
            offset += n
    ends = np.concatenate([*newlines, np.array([offset], dtype=np.int64)]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    keep = ends > starts
    return starts[keep], ends[keep]


def _foreign(path: str) -> str:
    """' It looks like <format>, not JSON Lines.' for a binary file, else ''."""
    try:
        if is_remote(path):
            head = remote_head(open_blob(path))
        else:
            with open(path, "rb") as f:
                head = f.read(4096)
    except OSError:
        return ""
    if head.startswith(b"\x80"):
        what = "a Python pickle"
    elif head.startswith(b"PAR1"):
        what = "a Parquet file (use ParquetSource)"
    elif head.startswith(b"PK\x03\x04"):
        what = "a zip archive"
    elif head.startswith(b"\x1f\x8b"):
        what = "a gzip file (decompress it first)"
    elif head.startswith(b"\x28\xb5\x2f\xfd"):
        what = "a zstd file (decompress it first)"
    elif b"\0" in head:
        what = "a binary file (an ArrayRecord file? use ArrayRecordSource)"
    else:
        return ""
    return f" It looks like {what}, not JSON Lines."


def _surrogate(flat: Mapping[str, Any]) -> str | None:
    """The first field whose text (or a text in its list) holds a lone surrogate, or None."""
    for name, value in flat.items():
        for text in value if type(value) is list else (value,):
            if type(text) is str and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return name
    return None


class JsonlSource(FileHandles):
    """One JSON object per line; files are concatenated in order into one record numbering.

    `schema` maps each field (nested keys joined with "/") to one of `KINDS`; without it, the
    schema is inferred from the first `infer_records` lines of the first file (and the first line
    of every other file is checked against it at construction). `src.schema` shows it: pass it back as
    `schema=` to pin it. Every line read must have exactly the schema's fields with values of
    their kinds. Columns: int -> int64, float -> float64, bool -> bool, str/any -> object;
    a list field is a 2-D array of its element type in every read, and a line whose list has
    another length is a `DecodeError` — unless the field is ragged: named in `ragged`, or (with
    an inferred schema) of varying length in the inferred lines; ragged fields are object arrays
    in every read.

    Each file's identity (inode, size, mtime) is checked after every read: a file rewritten
    under a running job is a `SourceError` naming it.
    """

    _transient = ("_files", "_checks")

    def __init__(self, paths: Paths, ragged: Collection[str] = (), *,
                 schema: Mapping[str, str] | None = None,
                 infer_records: int = INFER_RECORDS, max_open_files: int = MAX_OPEN_FILES) -> None:
        self.paths = expand_paths(paths, "JsonlSource")
        self._stamps: list[FileStamp] = [stamp(p, "JsonlSource") for p in self.paths]
        self._blobs = map_files(pin, self.paths)  # objects: version pinned for every process
        self.ragged = frozenset(ragged)
        blobs = dict(zip(self.paths, self._blobs))

        def line_spans(path: str) -> tuple[np.ndarray, np.ndarray]:
            blob = blobs[path]
            return _line_spans(path) if blob is None else remote_line_spans(blob)

        spans = map_files(line_spans, self.paths)  # every file's line index, on a few threads
        self._file_ends = np.cumsum([len(s) for s, _ in spans])
        self._starts = np.concatenate([s for s, _ in spans])
        self._ends = np.concatenate([e for _, e in spans])
        self.max_open_files = max_open_files
        self._files = OpenFiles(max_open_files, os.close)  # descriptors, at most max_open_files
        self._what = repr(self)  # as_indices names the source; repr is too slow per read
        if schema is not None:
            self.schema = validate_schema(schema)
            self._schema_origin = "the schema given to JsonlSource"
        else:
            if isinstance(infer_records, bool) or not isinstance(infer_records, int) \
                    or infer_records < 1:
                raise ValueError(f"JsonlSource: infer_records must be a positive integer, got "
                                 f"{infer_records!r}")
            self.schema = self._infer(infer_records)
        self._compile()
        unknown = sorted(self.ragged - set(self.schema))
        if unknown:
            raise ValueError(f"JsonlSource: ragged names {unknown}, which are not fields of the "
                             f"records (they have {sorted(self.schema)}); fix `ragged`.")
        if schema is None:  # fail at construction on a file that does not fit, not at step N
            firsts = [int(e) - len(s) for (s, _), e in zip(spans, self._file_ends) if len(s)]
            for record in firsts:
                if record >= self._infer_end:  # the lines before were inferred from
                    try:
                        row = self._parse(record)
                    except DecodeError:
                        continue  # one bad line: reported when it is read
                    self._check(record, row)
        self._close_fds()
        log.debug("%r: %d records, schema %s", self, len(self), self.schema)

    # --- schema --------------------------------------------------------------------------------
    def _infer(self, count: int) -> dict[str, str]:
        """Fields of the first line that parses; kinds of the first `count` lines, widened where
        they agree (int and float -> float). Lines that disagree with the first (another type,
        other fields, a null) are logged here and raise when read; lines that do not parse are
        left for `read` to report."""
        kinds: dict[str, str] = {}
        first_seen: dict[str, int] = {}
        lengths: dict[str, set[int]] = {}  # list fields: the lengths the inferred lines have
        keys: tuple[str, ...] | None = None
        first_record, problem = -1, ""
        odd: list[str] = []
        # Lines of the first file that has any: other files are checked against them.
        first_file = int(np.searchsorted(self._file_ends, 0, side="right"))
        begin = int(self._file_ends[first_file - 1]) if 0 < first_file < len(self.paths) else 0
        window = min(count, len(self) - begin)
        if first_file < len(self.paths):
            window = min(window, int(self._file_ends[first_file]) - begin)
        self._infer_end = begin + window
        lines = self._fetch_lines(np.arange(begin, begin + window), [first_file] * max(window, 0))
        for record, line in zip(range(begin, begin + window), lines):
            try:
                row = self._parse(record, line=line)
            except DecodeError as e:
                problem = problem or str(e)
                continue
            flat = flatten(row)
            if keys is None:
                keys, first_record = tuple(flat), record
            elif set(flat) != set(keys):
                odd.append(f"{self._where(record)} has fields {sorted(flat)}, not {sorted(keys)}")
            for name, value in flat.items():
                if name not in keys:
                    continue
                kind = kind_of(value)
                if kind == "null":
                    odd.append(f"{self._where(record)}: field {name!r} is null")
                    continue
                merged = merge(kinds[name], kind) if name in kinds else kind
                if merged is None:
                    odd.append(f"{self._where(record)}: field {name!r} is {kind} but "
                               f"{self._where(first_seen[name])} has it {kinds[name]}")
                    continue
                first_seen.setdefault(name, record)
                kinds[name] = merged
                if type(value) is list:
                    lengths.setdefault(name, set()).add(len(value))
        if keys is None:
            if not window:
                self._schema_origin = "empty files"
                return {}
            path = self.paths[first_file]
            raise DecodeError(f"{path}: none of the first {window} lines is a JSON "
                              f"object, so the records' fields cannot be inferred ({problem})."
                              f"{_foreign(path)} Pass JSON Lines files.")
        self._schema_origin = (f"the schema inferred from {self._where(first_record)} .. line "
                               f"{self._line_number(begin + window - 1)}")
        # Lists whose length varies in the inferred lines are ragged in every read (object
        # arrays), not 2-D in the reads whose lines happen to agree.
        self.ragged = self.ragged | {k for k, n in lengths.items() if len(n) > 1}
        schema = {}
        for name in keys:
            kind = kinds.get(name, "any")  # null in every inferred line: no type to check
            schema[name] = "list" if kind == "list[]" else kind
        if odd:
            log.warning("JsonlSource: the first %d lines disagree (%s%s); reading those lines "
                        "will raise. Inferred schema: %s. Fix the data or pass schema=.", window,
                        "; ".join(odd[:3]), f"; and {len(odd) - 3} more" if len(odd) > 3 else "",
                        schema)
        return schema

    def _compile(self) -> None:
        self._keys = frozenset(self.schema)
        self._nested = any("/" in k for k in self.schema)
        self._checks = [(k, kind, checker(kind)) for k, kind in self.schema.items() if kind != "any"]

    def _fields_error(self, record: int, flat: Mapping[str, Any], schema: Mapping[str, str],
                      origin: str) -> DecodeError:
        missing = sorted(set(schema) - set(flat))
        extra = sorted(set(flat) - set(schema))
        parts = []
        if missing:
            parts.append(f"field {missing[0]!r} is missing" if len(missing) == 1
                         else f"fields {missing} are missing")
        if extra:
            parts.append(f"field {extra[0]!r} is not in the schema" if len(extra) == 1
                         else f"fields {extra} are not in the schema")
        return DecodeError(
            f"{self._where(record)}: {' and '.join(parts)} (the line has fields {sorted(flat)}; "
            f"{origin} has {sorted(schema)}). Every line must have the same fields: fix that "
            "line, or write the field in every line (a null needs schema type 'any').")

    def _check(self, record: int, row: dict[str, Any]) -> dict[str, Any]:
        flat = flatten(row) if self._nested else row
        if flat.keys() != self._keys:
            raise self._fields_error(record, flat, self.schema, self._schema_origin)
        for name, kind, ok in self._checks:
            value = flat[name]
            if not ok(value):
                got = kind_of(value)
                got = "an empty list" if got == "list[]" else got
                raise DecodeError(
                    f"{self._where(record)}: field {name!r} is {got} ({short(value)}) but "
                    f"{self._schema_origin} says {kind}. A field must keep one type in every "
                    f"line, or a column's dtype would depend on which lines a read touched; "
                    f"{hint(name, (got,))}.")
        return flat

    # --- files ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        return f"JsonlSource({self._head()})"

    def _reset(self) -> None:
        self._files = OpenFiles(self.max_open_files, os.close)
        self._compile()

    def _close_fds(self) -> None:
        files = getattr(self, "_files", None)
        if files is not None:
            files.close_all()

    def __del__(self) -> None:
        self._close_fds()

    def _open_fd(self, file: int) -> int:
        """A descriptor of `file` (shared by threads: pread has no file position to race on)."""
        err = changed(self.paths[file], self._stamps[file], "JsonlSource")
        if err is not None:  # never read another version of the file
            raise err
        try:
            return os.open(self.paths[file], os.O_RDONLY)
        except OSError as e:
            raise open_error(self.paths[file], e, "JsonlSource", self.max_open_files) from e

    def _file_of(self, record: int) -> int:
        return int(np.searchsorted(self._file_ends, record, side="right"))

    def _line_number(self, record: int) -> int:
        """1-based line number in its file (error path only: it rescans the file's prefix)."""
        remaining, count = int(self._starts[record]), 1
        blob = self._blobs[self._file_of(record)]
        if blob is not None:  # an object: its non-empty lines are what the index counts
            first = int(self._file_ends[self._file_of(record) - 1]) if self._file_of(record) else 0
            return record - first + 1
        with open(self.paths[self._file_of(record)], "rb") as f:
            while remaining > 0:
                chunk = f.read(min(remaining, _SCAN_CHUNK))
                if not chunk:
                    break
                count += chunk.count(b"\n")
                remaining -= len(chunk)
        return count

    def _where(self, record: int) -> str:
        path = self.paths[self._file_of(record)]
        return f"{path}: line {self._line_number(record)} (record {record})"

    def _parse(self, record: int, file: int | None = None,
               line: bytes | None = None) -> dict[str, Any]:
        file = self._file_of(record) if file is None else file
        start, end = int(self._starts[record]), int(self._ends[record])
        if line is None:
            blob = self._blobs[file]
            if blob is None:
                with self._files.use(file, lambda: self._open_fd(file)) as fd:
                    line = os.pread(fd, end - start, start)
            else:
                line = blob.read(start, end - start)
        if len(line) != end - start:
            err = changed(self.paths[file], self._stamps[file], "JsonlSource")
            raise SourceError(f"{self._where(record)}: file is shorter than when it was "
                              "indexed; it changed after the source was built. Rebuild the "
                              "source after the file is complete.") from err
        try:
            row = loads(line)
        except UnicodeDecodeError as e:
            raise DecodeError(f"{self._where(record)}: not UTF-8 text (byte 0x{line[e.start]:02x} "
                              f"at column {e.start + 1}); JSON Lines files must be UTF-8. "
                              "Re-encode the file (e.g. iconv -f latin1 -t utf-8)."
                              f"{_foreign(self.paths[file])}") from None
        except ValueError as e:  # JSONDecodeError
            raise DecodeError(f"{self._where(record)}: not valid JSON ({e}). Fix or remove "
                              f"that line.{_foreign(self.paths[file])}") from e
        if not isinstance(row, dict):
            raise DecodeError(f"{self._where(record)}: is a JSON {type(row).__name__}, but "
                              "each line must be a JSON object (field name -> value).")
        if b"\\ud" in line.lower() or b"\xed" in line:  # a surrogate escape, or one in UTF-8 bytes
            name = _surrogate(flatten(row))
            if name is not None:
                raise DecodeError(f"{self._where(record)}: field {name!r} holds a lone surrogate (a "
                                  "\\ud800-\\udfff escape without its pair), which is not text: "
                                  "fix that line (its writer cut a UTF-16 pair in two).")
        return row

    # --- reading -------------------------------------------------------------------------------
    def read(self, indices: np.ndarray) -> Columns:
        idx = as_indices(indices, len(self), self._what)
        files = np.searchsorted(self._file_ends, idx, side="right").tolist()
        try:
            lines = self._fetch_lines(idx, files)
            rows = [self._check(record, self._parse(record, file, line))
                    for record, file, line in zip(idx.tolist(), files, lines)]
        except DecodeError as e:  # a bad line, or a file rewritten under us?
            for f in sorted(set(files)):
                err = changed(self.paths[f], self._stamps[f], "JsonlSource")
                if err is not None:
                    raise err from e
            raise
        # Once per read, after it: the lines above come from the files the source indexed.
        check_unchanged(self.paths, self._stamps, sorted(set(files)), "JsonlSource")
        return {name: self._column(name, kind, [row[name] for row in rows], idx)
                for name, kind in self.schema.items()}

    def _fetch_lines(self, idx: np.ndarray, files: list[int]) -> list[bytes | None]:
        """The lines of objects, fetched together (concurrently, nearby lines merged); None for
        lines of local files, which `_parse` preads."""
        lines: list[bytes | None] = [None] * len(idx)
        for f in sorted({f for f in files if self._blobs[f] is not None}):
            blob = self._blobs[f]
            assert blob is not None
            pos = [i for i, g in enumerate(files) if g == f]
            rec = idx[pos]
            got = blob.read_ranges(list(zip(self._starts[rec].tolist(),
                                            (self._ends[rec] - self._starts[rec]).tolist())))
            for i, data in zip(pos, got):
                lines[i] = data
        return lines

    def _column(self, name: str, kind: str, values: list[Any], idx: np.ndarray) -> np.ndarray:
        if not values:
            return np.empty(0, dtype={"int": np.int64, "float": np.float64,
                                      "bool": np.bool_}.get(kind, object))
        if kind in ("str", "any") or name in self.ragged:
            return objects(values)
        if kind in ("int", "float", "bool"):
            dtype = {"int": np.int64, "float": np.float64, "bool": np.bool_}[kind]
            try:
                return np.array(values, dtype=dtype)
            except OverflowError:
                bad = next(i for i, v in enumerate(values) if not -2**63 <= v < 2**63)
                raise DecodeError(f"{self._where(int(idx[bad]))}: field {name!r} is {values[bad]}, "
                                  "beyond int64; store it as a string, or pass "
                                  f"schema={{{name!r}: 'any'}}.") from None
        # A list field not named in `ragged` is a 2-D column of the schema's element type in
        # every read; a read that cannot give one is refused, never turned into objects (its dtype
        # would then depend on which lines the read touched).
        n = len(values[0])
        odd = next((i for i, v in enumerate(values) if len(v) != n), None)
        if odd is not None:
            raise DecodeError(f"{self._where(int(idx[odd]))}: field {name!r} has {len(values[odd])} "
                              f"elements but {self._where(int(idx[0]))} has {n}; a list field has one "
                              f"length in every line unless it is ragged: pass ragged=[{name!r}] "
                              "(object arrays in every read), or fix the data.")
        element = {"list[int]": np.int64, "list[float]": np.float64, "list[bool]": np.bool_}.get(kind)
        if element is None:
            return stack(values)
        try:
            return np.array(values, dtype=element).reshape(len(values), n)
        except (OverflowError, ValueError, TypeError):
            bad = next((i for i, v in enumerate(values) if any(not -2**63 <= x < 2**63 for x in v)), 0)
            raise DecodeError(f"{self._where(int(idx[bad]))}: field {name!r} holds a number beyond "
                              f"{kind[5:-1]}64 ({short(values[bad])}); store such values as strings, or "
                              f"pass schema={{{name!r}: 'list'}} (an object column).") from None


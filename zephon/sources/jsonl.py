"""JSON Lines files as a random-access source.

Construction scans each file once for newlines (numpy over fixed-size chunks, so memory stays
bounded) and keeps each record's byte span; a read fetches only the requested lines.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Collection
from typing import Any

import numpy as np

from ..errors import DecodeError, SourceError
from .base import Columns, as_indices
from .paths import Paths, expand_paths
from .spec import rows_to_columns

log = logging.getLogger(__name__)

_SCAN_CHUNK = 16 << 20


def _line_spans(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte [start, end) of every non-empty line; empty lines (blank separators, the newline at
    end of file) are not records. A trailing '\\r' is left to json.loads, which ignores it."""
    newlines = []
    buf = bytearray(_SCAN_CHUNK)
    offset = 0
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            chunk = np.frombuffer(buf, dtype=np.uint8, count=n)
            newlines.append(np.flatnonzero(chunk == ord("\n")) + offset)
            offset += n
    ends = np.concatenate([*newlines, np.array([offset], dtype=np.int64)]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    keep = ends > starts
    return starts[keep], ends[keep]


class JsonlSource:
    """One JSON object per line; files are concatenated in order into one record numbering.

    JSON has no schema, so a list field stacks to a 2-D array when the rows of a read agree in
    length; name variable-length fields in `ragged` to get object arrays in every read (see
    `rows_to_columns`).
    """

    def __init__(self, paths: Paths, ragged: Collection[str] = ()) -> None:
        self.paths = expand_paths(paths, "JsonlSource")
        self.ragged = frozenset(ragged)
        spans = [_line_spans(p) for p in self.paths]
        self._file_ends = np.cumsum([len(s) for s, _ in spans])
        self._starts = np.concatenate([s for s, _ in spans])
        self._ends = np.concatenate([e for _, e in spans])
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        log.debug("%r: %d records", self, len(self))
        self._what = repr(self)  # as_indices names the source; repr is too slow per read

    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        head = self.paths[0] + (f" (+{len(self.paths) - 1} more)" if len(self.paths) > 1 else "")
        return f"JsonlSource({head!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_fds"], state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fds = {}
        self._lock = threading.Lock()

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)

    def _fd(self, file: int) -> int:
        """One descriptor per file, shared by threads: pread has no file position to race on."""
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = self._fds[file] = os.open(self.paths[file], os.O_RDONLY)
        return fd

    def _file_of(self, record: int) -> int:
        return int(np.searchsorted(self._file_ends, record, side="right"))

    def _line_number(self, record: int) -> int:
        """1-based line number in its file (error path only: it rescans the file's prefix)."""
        with open(self.paths[self._file_of(record)], "rb") as f:
            return f.read(int(self._starts[record])).count(b"\n") + 1

    def _where(self, record: int) -> str:
        path = self.paths[self._file_of(record)]
        return f"{path}: line {self._line_number(record)} (record {record})"

    def read(self, indices: np.ndarray) -> Columns:
        idx = as_indices(indices, len(self), self._what)
        files = np.searchsorted(self._file_ends, idx, side="right").tolist()
        rows = []
        for record, file, start, end in zip(idx.tolist(), files, self._starts[idx].tolist(),
                                            self._ends[idx].tolist()):
            line = os.pread(self._fd(file), end - start, start)
            if len(line) != end - start:
                raise SourceError(f"{self._where(record)}: file is shorter than when it was "
                                  "indexed; it changed after the source was built. Rebuild the "
                                  "source after the file is complete.")
            try:
                row = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise DecodeError(f"{self._where(record)}: not valid JSON ({e}). Fix or remove "
                                  "that line.") from e
            if not isinstance(row, dict):
                raise DecodeError(f"{self._where(record)}: is a JSON {type(row).__name__}, but "
                                  "each line must be a JSON object (field name -> value).")
            rows.append(row)
        return rows_to_columns(rows, lambda i: self._where(int(idx[i])), self.ragged)

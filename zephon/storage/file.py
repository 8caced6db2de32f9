"""A pinned object as a read-only, seekable binary file, for readers that want a file object
(pyarrow's Parquet reader). Every read is one ranged request under the storage policy."""

from __future__ import annotations

import bisect
import io
import os
import threading

from .blob import Blob


class BlobFile(io.RawIOBase):
    """`spans`, if given, holds byte ranges fetched ahead (`Spans`): a read inside one is served
    from memory instead of a request (a block-shuffled Parquet read fetches a window's column
    chunks together, in few merged requests, before pyarrow asks for them one by one)."""

    def __init__(self, blob: Blob, spans: Spans | None = None) -> None:
        super().__init__()
        self.blob = blob
        self.name = blob.url
        self._pos = 0
        self._spans = spans

    def _get(self, offset: int, n: int) -> bytes:
        if self._spans is not None:
            got = self._spans.find(offset, n)
            if got is not None:
                return got
        return self.blob.read(offset, n)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def size(self) -> int:
        return self.blob.size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.blob.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self.blob.size - self._pos))
        if n:
            memoryview(buffer)[:n] = self._get(self._pos, n)
            self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        n = self.blob.size - self._pos if size is None or size < 0 else size
        n = max(0, min(n, self.blob.size - self._pos))
        data = self._get(self._pos, n) if n else b""
        self._pos += n
        return data


class Spans:
    """Byte ranges of one object fetched ahead, by start; thread safe."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._data: list[bytes] = []
        self._lock = threading.Lock()

    def add(self, ranges: list[tuple[int, int]], datas: list[bytes]) -> None:
        """Adds ranges (offset, length) and their bytes; touching ranges become one span (a
        reader may read neighbouring column chunks in one call)."""
        merged: list[tuple[int, list[bytes], int]] = []
        for (start, n), data in sorted(zip(ranges, datas), key=lambda x: x[0][0]):
            if merged and merged[-1][2] == start:
                merged[-1][1].append(data)
                merged[-1] = (merged[-1][0], merged[-1][1], start + n)
            else:
                merged.append((start, [data], start + n))
        with self._lock:
            for start, parts, _ in merged:
                i = bisect.bisect_left(self._starts, start)
                self._starts.insert(i, start)
                self._data.insert(i, b"".join(parts))

    def find(self, offset: int, n: int) -> bytes | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, offset) - 1
            if i < 0:
                return None
            start, data = self._starts[i], self._data[i]
        if offset + n <= start + len(data):
            return data[offset - start:offset - start + n]
        return None

    def clear(self) -> None:
        with self._lock:
            self._starts.clear()
            self._data.clear()

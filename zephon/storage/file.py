"""A pinned object as a read-only, seekable binary file, for readers that want a file object
(pyarrow's Parquet reader). Every read is one ranged request under the storage policy."""

from __future__ import annotations

import io
import os

from .blob import Blob


class BlobFile(io.RawIOBase):
    def __init__(self, blob: Blob) -> None:
        super().__init__()
        self.blob = blob
        self.name = blob.url
        self._pos = 0

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
            memoryview(buffer)[:n] = self.blob.read(self._pos, n)
            self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        n = self.blob.size - self._pos if size is None or size < 0 else size
        n = max(0, min(n, self.blob.size - self._pos))
        data = self.blob.read(self._pos, n) if n else b""
        self._pos += n
        return data

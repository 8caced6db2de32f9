"""An optional local cache of the byte ranges read from object storage, for data read again
(repeated epochs, several jobs on one host).

Off by default; on with ZEPHON_STORAGE_CACHE_BYTES=<budget in bytes> (or
`storage.configure(cache_bytes=...)`). Entries live in `$ZEPHON_CACHE_DIR/bytes` (default
`~/.cache/zephon/bytes`), one file per range a format asked for, named by (URL, version, offset,
length), so a new version of an object never hits an old entry. Each entry carries the SHA-256 of
its bytes and is checked on every hit: a corrupt entry is deleted and fetched again. Entries are
written to a temp file and renamed into place, so the processes of one host share the cache
safely. When the budget is exceeded, the least recently used entries are deleted down to 80 %
of it. The cache only ever deletes its own local files: nothing remote is modified.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)
_MAGIC = b"ZPHC1\n"
_lock = threading.Lock()
_usage: dict[str, int] = {}  # cache dir -> bytes this process believes it holds


def cache_root() -> str:
    root = os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "zephon")
    return os.path.join(root, "bytes")


def _entry(url: str, version: str, offset: int, length: int) -> str:
    obj = hashlib.sha256(f"{url}\0{version}".encode()).hexdigest()[:24]
    return os.path.join(cache_root(), obj[:2], obj, f"{offset}-{length}")


def lookup(url: str, version: str, ranges: Sequence[tuple[int, int]]) -> list[bytes | None]:
    """Cached bytes of each range, or None (missing or corrupt: a corrupt entry is deleted)."""
    out: list[bytes | None] = []
    for offset, length in ranges:
        path = _entry(url, version, offset, length)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            out.append(None)
            continue
        head = len(_MAGIC) + 32
        data = raw[head:]
        if raw[:len(_MAGIC)] != _MAGIC or len(data) != length or hashlib.sha256(data).digest() != raw[len(_MAGIC):head]:
            log.warning("cache entry %s is corrupt; fetching the range again", path)
            with contextlib.suppress(OSError):
                os.unlink(path)
            out.append(None)
            continue
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        out.append(data)
    return out


def store(url: str, version: str, ranges: Sequence[tuple[int, int]], datas: Sequence[bytes],
          budget: int) -> None:
    """Writes entries atomically, then evicts down to 80 % of `budget` if it is exceeded."""
    written = 0
    for (offset, length), data in zip(ranges, datas):
        path = _entry(url, version, offset, length)
        tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(data).digest() + data)
            os.replace(tmp, path)
            written += len(data) + len(_MAGIC) + 32
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("cannot write the cache entry %s (%s); reading on without it", path, e)
            return
    root = cache_root()
    with _lock:
        if root not in _usage:
            _usage[root] = _scan(root)[1]
        else:
            _usage[root] += written
        over = _usage[root] > budget
    if over:
        evict(int(budget * 0.8))


def _scan(root: str) -> tuple[list[tuple[float, int, str]], int]:
    entries = []
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            with contextlib.suppress(OSError):
                st = os.stat(path)
                entries.append((st.st_mtime, st.st_size, path))
    return entries, sum(e[1] for e in entries)


def evict(target: int) -> int:
    """Deletes least recently used entries until the cache holds at most `target` bytes."""
    root = cache_root()
    entries, total = _scan(root)
    for _, size, path in sorted(entries):
        if total <= target:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
            total -= size
    with _lock:
        _usage[root] = total
    return total

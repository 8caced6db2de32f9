"""What a file source leaves behind when it is pickled, and reopens on the other side.

A source over files keeps things that belong to one process: descriptors, readers, locks, caches,
thread pools. A runner pickles sources into its worker processes, so each file source names those
attributes in `_transient`, ships only what identifies the data (paths, stamps, the index it
built) and rebuilds the rest lazily with `_reset()` where it lands. `OpenFiles` bounds how many
handles a source keeps open at once.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, ClassVar

from ..errors import SourceError


class FileHandles:
    """Base of the file sources: pickling without per-process handles, and the repr's head."""

    #: Attributes that belong to one process: dropped when pickled, rebuilt by `_reset`.
    _transient: ClassVar[tuple[str, ...]] = ()
    paths: list[str]

    def _reset(self) -> None:
        """Rebuilds the `_transient` attributes (empty: handles open on first use)."""
        raise NotImplementedError

    def _head(self) -> str:
        """The first path, and how many more follow: what the repr names (one line, any count)."""
        more = f" (+{len(self.paths) - 1} more)" if len(self.paths) > 1 else ""
        return repr(self.paths[0] + more)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in self._transient:
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()


#: Files one source keeps open at most (its least recently used are closed first).
MAX_OPEN_FILES = 64


class OpenFiles:
    """A bounded set of open handles (descriptors, readers), least recently used closed first.

    A source over thousands of shards would otherwise hold one descriptor per shard (per decode
    thread) and hit the process's limit (`ulimit -n`). A handle in use (`with use(...)`) is never
    closed under its user: eviction skips it, so a descriptor number is never reused by another
    file mid-read.
    """

    def __init__(self, limit: int, close: Callable[[Any], None]) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_open_files must be a positive integer, got {limit!r}")
        self.limit = limit
        self._close = close
        self._open: OrderedDict[Hashable, Any] = OrderedDict()
        self._busy: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    @contextlib.contextmanager
    def use(self, key: Hashable, opener: Callable[[], Any]) -> Iterator[Any]:
        """The handle for `key` (opened with `opener()` if not open), kept open while in use."""
        with self._lock:
            handle = self._open.get(key)
            if handle is None:
                handle = self._open[key] = opener()
            self._open.move_to_end(key)
            self._busy[key] = self._busy.get(key, 0) + 1
            self._evict()
        try:
            yield handle
        finally:
            with self._lock:
                left = self._busy.pop(key) - 1
                if left:
                    self._busy[key] = left
                self._evict()

    def _evict(self) -> None:
        while len(self._open) > self.limit:
            victim = next((k for k in self._open if k not in self._busy), None)
            if victim is None:
                return  # every handle is in use: the bound is restored when they are released
            self._close(self._open.pop(victim))

    def close_all(self) -> None:
        with self._lock:
            handles, self._open = list(self._open.values()), OrderedDict()
        for h in handles:
            self._close(h)


def open_error(path: str, e: OSError, what: str, limit: int = MAX_OPEN_FILES) -> OSError:
    """The error for a file that could not be opened: EMFILE/ENFILE named for what they are."""
    if e.errno in (errno.EMFILE, errno.ENFILE):
        try:
            import resource

            soft = f" (ulimit -n is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
        except (ImportError, OSError, ValueError):
            soft = ""
        scope = "this process" if e.errno == errno.EMFILE else "the system"
        return SourceError(f"{what}: cannot open {path}: too many open files "
                           f"({errno.errorcode[e.errno]}): {scope} reached its descriptor limit{soft}. "
                           f"Each source keeps at most max_open_files={limit} files open; raise the "
                           "limit (ulimit -n), lower max_open_files, or close other loaders.")
    return SourceError(f"{what}: cannot open {path}: {e.strerror or e}")

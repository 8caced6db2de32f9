"""What a file source leaves behind when it is pickled, and reopens on the other side.

A source over files keeps things that belong to one process: descriptors, readers, locks, caches,
thread pools. A runner pickles sources into its worker processes, so each file source names those
attributes in `_transient`, ships only what identifies the data (paths, stamps, the index it
built) and rebuilds the rest lazily with `_reset()` where it lands.
"""

from __future__ import annotations

from typing import Any, ClassVar


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

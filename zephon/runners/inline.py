"""The inline runner: every item computed in the consumer's thread, when it is asked for.

The reference every other runner must agree with, and the default: no threads, no processes, no
prefetch, so nothing to start, close or leak, and tracebacks point straight at the failing code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from zephon.runners.base import R, T


@dataclass(frozen=True)
class Inline:
    """Runs each item in the consumer's thread when it is asked for."""

    def imap(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        return map(fn, items)

    def close(self) -> None:
        """Nothing to release."""

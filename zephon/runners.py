"""Runners execute a pure step function; they change speed, never data.

A runner offers `imap(fn, steps)` returning results in step order with bounded read-ahead.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Protocol


class Runner(Protocol):
    def imap(self, fn: Callable[[int], Any], steps: Iterable[int]) -> Iterator[Any]: ...


class Inline:
    """Runs each step in the consumer's thread when it is asked for."""

    def imap(self, fn: Callable[[int], Any], steps: Iterable[int]) -> Iterator[Any]:
        return map(fn, steps)

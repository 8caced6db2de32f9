"""Helpers several test modules share (tests/ is on sys.path under pytest's rootdir conftest)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fails the test instead of hanging it (a guard, not a timing assertion)."""
    def fail(*_: object) -> None:
        raise TimeoutError(f"no result within {seconds} s: the consumer hung")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)

"""The thread runner: a thread pool computing a bounded number of items ahead, yielded in order.

Threads share the consumer's memory, so results need no transport at all; they overlap wherever
the work releases the GIL (ArrayRecord's C++ reader, pyarrow, large numpy operations) and do not
overlap pure-Python work — use `processes(n)` for that.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from zephon.errors import check_positive_int
from zephon.runners.base import END, R, T, available_cores, set_native_threads
from zephon.runners.closing import DaemonPool


class Threads:
    """A thread pool computing up to `depth` items ahead of the consumer, yielded in order.

    Args:
      workers: threads in the pool (default: the CPUs this process may use).
      depth: items in flight (default 2 per thread); bounds memory with the item size.

    An exception raised by `fn` is re-raised in the consumer unchanged (same type as inline). The
    pool is made on first use, so a configured runner costs nothing until it runs.
    """

    def __init__(self, workers: int | None = None, *, depth: int | None = None) -> None:
        self.workers = check_positive_int(available_cores() if workers is None else workers, "threads(workers)")
        self.depth = check_positive_int(2 * self.workers if depth is None else depth, "threads(depth)")
        self._pool: DaemonPool | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"threads({self.workers}, depth={self.depth})"

    def __getstate__(self) -> dict[str, Any]:
        """A runner pickles as its configuration; the copy makes its own pool when used."""
        return {"workers": self.workers, "depth": self.depth}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["workers"], depth=state["depth"])  # type: ignore[misc]

    def _executor(self) -> DaemonPool:
        with self._lock:
            if self._pool is None:
                # each thread's share of the cores for native engines, which would otherwise
                # each start a pool as large as the machine
                # daemon threads: a worker stuck in a read never holds up close() past its
                # bound, nor the interpreter's exit (zephon.runners.closing)
                self._pool = DaemonPool(self.workers, "zephon", initializer=set_native_threads,
                                        initargs=(max(1, available_cores() // self.workers),))
            return self._pool

    def imap(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        pool = self._executor()
        source = iter(items)
        window: deque[Future[R]] = deque(pool.submit(fn, item)
                                         for item in itertools.islice(source, self.depth))
        try:
            while window:
                result = window.popleft().result()
                nxt = next(source, END)
                if nxt is not END:
                    window.append(pool.submit(fn, nxt))
                yield result
        finally:
            for fut in window:
                fut.cancel()

    def close(self) -> None:
        """Shuts the pool down: cancels queued items and waits for running ones at most
        `zephon.runners.closing.STOP_TIMEOUT_S` (a thread still running is abandoned with a warning)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

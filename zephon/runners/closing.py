"""Bounded stops: closing a loader never waits forever for a thread.

A prefetch thread (the Grain-compatible `ThreadPrefetchIterDataset`, `JaxLoader`'s) or a
`threads()` runner's worker can be stuck in a source's `read` (a network file system that
hangs, a user function that blocks): joining it without a bound turns `close()`, a garbage
collector's `__del__` or the interpreter's exit into a hang. Every close path joins through
`join_bounded`: the threads get `STOP_TIMEOUT_S` seconds in all; one still running is
abandoned with a warning naming it — it is a daemon thread, so it ends with the process and
never holds up the interpreter's exit. One helper, used by every emitter, so the bound and the
message are the same everywhere.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)


def _default_timeout() -> float:
    try:
        return max(0.0, float(os.environ.get("ZEPHON_STOP_TIMEOUT_S", "5")))
    except ValueError:
        return 5.0


#: Seconds a close waits, in all, for the threads it stops (`ZEPHON_STOP_TIMEOUT_S`, default 5).
STOP_TIMEOUT_S: float = _default_timeout()


def join_bounded(threads: Iterable[threading.Thread | None], what: str, timeout: float | None = None) -> bool:
    """Joins `threads` within `timeout` seconds in all (default `STOP_TIMEOUT_S`); True if every
    one stopped. One still running is left to run on — abandoned: it must be a daemon thread —
    and a warning names `what` and the threads. The calling thread itself is skipped (a
    `__del__` may run in the thread it stops)."""
    limit = STOP_TIMEOUT_S if timeout is None else timeout
    deadline = time.monotonic() + limit
    me = threading.current_thread()
    stuck: list[threading.Thread] = []
    for t in threads:
        if t is None or t is me or not t.is_alive():
            continue
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            stuck.append(t)
    if stuck:
        names = ", ".join(t.name for t in stuck)
        log.warning("%s: %d thread(s) (%s) did not stop within %.1f s of close — probably blocked in "
                    "a source's read or a transform; abandoned (daemon threads end with the process). "
                    "Make the source's reads time out to free them.", what, len(stuck), names, limit)
    return not stuck


class DaemonPool:
    """`ThreadPoolExecutor`'s `submit`/`shutdown` over daemon threads, so a worker stuck in a
    read is abandoned by `shutdown` after the bound (`join_bounded`) instead of holding up
    `close()` and the interpreter's exit (the standard pool's threads are joined at exit)."""

    def __init__(self, workers: int, name: str, initializer: Callable[..., Any] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=_work, args=(self._queue, initializer, initargs),
                                          name=f"{name}_{i}", daemon=True) for i in range(workers)]
        self._shut = False
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._shut:
            raise RuntimeError("cannot submit to a pool that was shut down")
        fut: Future[Any] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> bool:
        """Stops the threads once they finish their current item (queued items run first unless
        `cancel_futures`); waits at most `STOP_TIMEOUT_S` when `wait`. True if all stopped."""
        self._shut = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)
        return join_bounded(self._threads, "a threads() runner") if wait else True


def _work(q: queue.SimpleQueue[Any], initializer: Callable[..., Any] | None, initargs: tuple[Any, ...]) -> None:
    if initializer is not None:
        initializer(*initargs)
    while True:
        item = q.get()
        if item is None:
            return
        fut, fn, args = item
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args)
        except BaseException as e:  # the consumer re-raises it from the future
            fut.set_exception(e)
        else:
            fut.set_result(result)
        del item, fut, fn, args


__all__ = ["STOP_TIMEOUT_S", "DaemonPool", "join_bounded"]

"""The prefetch thread of `JaxLoader`: the loader and the host-side conversion run ahead.

A bounded queue carries host batches with the loader's position after each, so the caller's
state describes the batches it consumed, not the ones prefetched; a failure in the thread
reaches the caller as an item (`Failure`), never as a hang.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, replace
from typing import Any

from zephon.backends.jax.batch import Emitter, HostBatch
from zephon.errors import WorkerError
from zephon.exec.loader import Loader, LocalBatch
from zephon.runners.closing import join_bounded


class End:
    """Queue marker: the loader is exhausted (`JaxLoader` then raises StopIteration)."""


@dataclass(frozen=True)
class Failure:
    """Queue marker: the producer raised; the consumer (`JaxLoader.__next__`) re-raises it."""

    error: BaseException


#: a host batch, the loader's position after it, and its provenance (the batch without data)
Item = tuple[HostBatch, dict[str, Any], LocalBatch] | End | Failure


class Prefetcher:
    """A thread that runs the loader and the host-side conversion ahead of the caller.

    Device transfers are dispatched from the caller's thread (see `JaxLoader.__next__`): on the
    CPU backend a transfer issued from a second thread while a jitted step runs collectives
    across the fake devices can starve the step's rendezvous (XLA aborts after 40 s).

    The queue holds at most `depth` batches and the thread one more in progress. The thread
    references neither the prefetcher nor the JaxLoader, so an abandoned JaxLoader is collected
    and its finalizer stops the thread.
    """

    def __init__(self, loader: Loader, emit: Emitter, depth: int) -> None:
        self._queue: queue.Queue[Item] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(loader, emit, self._queue, self._stop),
                                        name="zephon-jax-prefetch", daemon=True)
        self._thread.start()

    def take(self) -> Item:
        """The next item; a thread that is gone without a word becomes an error, never a hang."""
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return Failure(WorkerError("the prefetch thread stopped (the JaxLoader was "
                                                "closed meanwhile); restore a state or create a "
                                                "new JaxLoader."))

    def stop(self) -> bool:
        """Ends the thread and drops the batches it built ahead; False if the thread did not stop
        within `zephon.runners.closing.STOP_TIMEOUT_S` (abandoned, still inside the loader).

        Draining wakes a producer blocked on the full queue, so it sees the stop at once instead
        of after building another batch.
        """
        self._stop.set()
        self._drain()
        stopped = join_bounded([self._thread], "JaxLoader's prefetch thread")  # never forever: zephon.runners.closing
        self._drain()
        return stopped

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


def _produce(loader: Loader, emit: Emitter, out: queue.Queue[Item], stop: threading.Event) -> None:
    def put(item: Item) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    try:
        while not stop.is_set():
            try:
                batch = next(loader)
            except StopIteration:
                put(End())
                return
            put((emit.host(batch), loader.position(), replace(batch, data={})))
    except BaseException as e:
        put(Failure(e))

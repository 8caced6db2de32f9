"""The runner contract: map a pure function over items, in order, faster; never change the data.

Everything that consumes a runner (the step path, `zephon.exec.steps`; the lane engine,
`zephon.exec.lanes`; the `Loader`) relies on this contract and nothing else, so a runner can be
swapped for speed alone. The contract is small on purpose:

- `imap(fn, items)` returns an iterator over `fn(item)` for every item, in item order. The runner
  may compute a bounded number of items ahead (its `depth`), never an unbounded number, so memory
  is bounded by the depth and not by the data set. Items are pulled from `items` lazily.
- An exception raised by `fn` is re-raised by the iterator at that item, with its original type;
  results of the items before it arrive first.
- The iterator may have a `close()` (generators do): callers that stop early call it when present
  (`getattr(results, "close", None)`), which cancels work still in flight.
- `close()` on the runner releases what it holds (threads, processes, shared memory); the runner
  starts them again on its next `imap`.

Terms (docs/glossary.md): runner, worker.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

T = TypeVar("T")
R = TypeVar("R")

END = object()  # `next(iterator, END)`: the end of the items, distinct from any item


@runtime_checkable
class Runner(Protocol):
    """What the loader needs of a runner (see the module docstring for the contract)."""

    def imap(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """`fn(item)` for every item, in order, computed at most `depth` items ahead."""
        ...

    def close(self) -> None:
        """Releases the runner's threads, processes and memory; it restarts when used again."""
        ...


def available_cores() -> int:
    """CPUs this process may run on (respects affinity masks and cgroup-pinned CPU sets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_share = threading.local()


def set_native_threads(n: int) -> None:
    """Runs in each of a runner's threads: the native threads its work may start (its share)."""
    _share.threads = n


def native_threads() -> int:
    """Threads a native engine (tiktoken's) may use from the calling thread: a `threads()`
    runner's share of the cores, a `processes()` worker's (RAYON_NUM_THREADS, which sizes
    `tokenizers`' own pool too), else the cores this process may use."""
    n = getattr(_share, "threads", None)
    if n:
        return int(n)
    env = os.environ.get("RAYON_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else available_cores()

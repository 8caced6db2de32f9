"""Runners execute a pure function over items, in order; they change speed, never data.

A runner offers `imap(fn, items)`: the results of `fn(item)` in item order, computed ahead of the
consumer with a bounded number of items in flight (`depth`), so memory is bounded by the depth and
never by the data set. Because `fn` is pure (the loader's step task: plan + sources + transforms),
which thread or process computes a result cannot change it; that is what lets the runner and the
worker count be chosen for speed alone.

- `inline()`: in the consumer's thread, when asked for. No parallelism, no prefetch.
- `threads(n)`: a thread pool. Sources whose bulk reads release the GIL (ArrayRecord's C++ reader,
  pyarrow, large numpy operations) overlap; Python work does not.
- `processes(n)`: worker processes (forkserver by default: no fork of a threaded parent), results
  handed back through anonymous shared memory that nothing can leak. A worker that dies raises
  `WorkerError`; `close()`, garbage collection and interpreter exit end the workers.

One concept a module:

  base.py        the `Runner` protocol (the contract callers rely on), `available_cores`
  inline.py      `Inline`
  threads.py     `Threads`
  processes.py   `Processes`: the consumer's side (start, submit, receive in order, liveness)
  worker.py      the worker process's loop
  messages.py    what travels between them, one frozen dataclass a message
  transport.py   the shared-memory slots (memfd / unlinked POSIX segments, SCM_RIGHTS)
  errors.py      how worker failures become exceptions in the consumer (`RemoteTraceback`)

Terms (docs/glossary.md): runner, worker.
"""

from __future__ import annotations

from zephon.errors import WorkerError
from zephon.runners.base import Runner, available_cores
from zephon.runners.errors import RemoteTraceback
from zephon.runners.inline import Inline
from zephon.runners.processes import Processes
from zephon.runners.threads import Threads

__all__ = [
    "Inline",
    "Processes",
    "RemoteTraceback",
    "Runner",
    "Threads",
    "WorkerError",
    "available_cores",
    "from_spec",
    "inline",
    "processes",
    "threads",
]


def inline() -> Inline:
    """Runs steps in the consumer's thread."""
    return Inline()


def threads(workers: int | None = None, *, depth: int | None = None) -> Threads:
    """A thread pool of `workers` (default: available cores) with `depth` items in flight."""
    return Threads(workers, depth=depth)


def processes(workers: int | None = None, *, depth: int | None = None,
              start_method: str | None = None, timeout: float | None = None) -> Processes:
    """Worker processes handing results back through shared memory; see `Processes`."""
    return Processes(workers, depth=depth, start_method=start_method, timeout=timeout)


def from_spec(spec: str) -> Runner:
    """'inline', 'threads', 'threads:4', 'processes', 'processes:2' -> a runner (CLI, benchmarks)."""
    name, _, count = spec.partition(":")
    if count and not count.isdigit():
        raise ValueError(f"runner {spec!r}: the worker count {count!r} is not a number; use e.g. "
                         "'threads:4' or 'processes:2'")
    n = int(count) if count else None
    if name == "inline" and not count:
        return Inline()
    if name == "threads":
        return Threads(n)
    if name == "processes":
        return Processes(n)
    raise ValueError(f"unknown runner {spec!r}; use 'inline', 'threads[:N]' or 'processes[:N]'")

"""How failures in worker processes become exceptions in the consumer.

Two kinds, kept apart on purpose:
- `fn` raised in a worker: the consumer re-raises the *same* exception type (so `processes(n)`
  behaves like `inline()` for a caller catching, say, KeyError), with the worker's formatted
  traceback chained as its cause (`RemoteTraceback`). An exception that does not survive pickling
  becomes a `WorkerError` carrying its type and message.
- the machinery failed (a worker died, hung, or its result cannot be unpickled here): always
  `zephon.errors.WorkerError`, whose message says what happened, the usual causes, and that the
  loader's state is unchanged.
"""

from __future__ import annotations

import pickle
import signal
import traceback
from typing import NoReturn

from zephon.errors import WorkerError
from zephon.runners.messages import Failed


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker process (chained as cause)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb}\"\"\""


# --- worker side -------------------------------------------------------------------------------
def failure(exc: BaseException) -> Failed:
    """The reply for an exception `fn` raised in a worker."""
    return Failed(_picklable(exc), f"{type(exc).__name__}: {exc}",
                  "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def _picklable(exc: BaseException) -> bytes | None:
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
        return blob
    except Exception:
        return None


# --- consumer side -----------------------------------------------------------------------------
def raise_failure(msg: Failed) -> NoReturn:
    """Re-raises a worker's exception with its original type, the worker traceback as cause."""
    remote = RemoteTraceback(msg.traceback)
    if msg.error is not None:
        raise pickle.loads(msg.error) from remote
    raise WorkerError(f"a worker raised {msg.summary} (the exception could not be pickled back); "
                      "see the worker traceback above.") from remote


def describe_exit(code: int | None) -> str:
    """'exit code 3', 'signal SIGKILL', ... for a process's exit code."""
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def worker_died(index: int, pid: int | None, code: int | None, doing: str) -> WorkerError:
    """A worker process ended while `doing` something: what it was, and the likely cause."""
    if code is not None and code > 0:
        cause = ("It exited on its own: usually an error while starting it (its traceback is "
                 "on stderr), e.g. a main module without an `if __name__ == '__main__':` "
                 "guard, which worker processes re-import.")
    else:
        cause = ("This is usually the kernel's out-of-memory killer (SIGKILL) or a crash in "
                 "native code; if memory ran out, use fewer workers or a smaller depth.")
    return WorkerError(
        f"worker process {index} (pid {pid}) died with {describe_exit(code)} while "
        f"{doing}; its results are lost. {cause} The loader's state is unchanged: fix the "
        "cause, then iterate again or resume from the last saved state.")


def worker_stuck(index: int, pid: int | None, item: int, timeout: float) -> WorkerError:
    return WorkerError(f"worker {index} (pid {pid}) gave no result for item {item} in "
                       f"{timeout:.0f} s; it is stuck (a deadlock or an endless transform). Fix "
                       "the transform or raise the runner's timeout.")


def function_unpicklable(exc: Exception) -> WorkerError:
    return WorkerError(f"the function for worker processes cannot be pickled ({exc!r}); define "
                       "transforms and sources at module level (no lambdas or closures), or use "
                       "threads() instead of processes().")


def result_unpicklable(item: int, exc: Exception) -> WorkerError:
    return WorkerError(f"the result of item {item} came back from a worker but cannot be "
                       f"unpickled here ({type(exc).__name__}: {exc}). Results must be made of "
                       "types this process can import (numpy arrays, dicts, module-level classes).")

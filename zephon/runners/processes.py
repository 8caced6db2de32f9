"""The process runner: worker processes computing items ahead, results handed over shared memory.

Each worker receives the pickled function once, then only items, round-robin; the consumer reads
the replies back in item order, so order never depends on which worker was fastest. Results come
back through the shared-memory transport (`zephon.runners.transport`): arrays never go through a
pipe, and the arrays handed to the consumer are views of a slot that is reused only after every
array viewing it has been garbage collected.

The consumer never blocks on a bare `recv`: it waits on the reply pipe *and* on every worker's
process sentinel, so a worker that dies (SIGKILL, the OOM killer, a crash in native code) raises
`WorkerError` at once instead of hanging. `close()`, garbage collection and interpreter exit
terminate the workers and release every slot.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import socket
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from zephon.errors import WorkerError, check_positive_int
from zephon.runners import errors
from zephon.runners.base import END, R, T, available_cores
from zephon.runners.messages import Done, Failed, Request, Run, SetFunction, Stop, decode, encode
from zephon.runners.transport import Slot, SlotPool, fd_socket, recv_fd, send_fd
from zephon.runners.worker import worker_main

log = logging.getLogger(__name__)

_POLL_SECONDS = 1.0  # upper bound between liveness checks while waiting for a worker


@dataclass(eq=False)
class _Task:
    """An item in flight on a worker, as the consumer remembers it."""

    index: int
    slot: Slot | None  # the slot lent for its result
    fresh: str  # the name the worker creates a segment under if `slot` is too small


@dataclass(eq=False)
class _Worker:
    process: Any  # a multiprocessing Process of the runner's context
    conn: mpc.Connection
    sock: socket.socket  # the same socketpair end as `conn`, for descriptors
    inflight: deque[_Task] = field(default_factory=deque)
    has_fn: bool = False
    retired_seen: int = 0
    mapped: set[str] = field(default_factory=set)  # slots this worker has mapped


_LIVE: weakref.WeakSet[Processes] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Interpreter exit: stop every runner's workers (daemon processes would be killed anyway,
    but closing first lets them exit cleanly)."""
    for runner in list(_LIVE):
        runner.close()


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """Workers started inside this block do not import the main module.

    Spawned and forkserver children re-import the parent's main script (all it imports with it)
    before their first item, only so that functions defined there can be unpickled: seconds a
    worker where a script imports a framework, on every start. (Python 3.11's forkserver cannot
    preload it once: its preload looks the script up under a key the preparation data never
    has.) The runner's function is pickled before its workers start, so when it names nothing
    in `__main__` the import is dropped from what the child prepares; a later function that does
    name something there restarts the workers with it.
    """
    from multiprocessing import spawn

    real = spawn.get_preparation_data

    def prepare(name: str) -> dict[str, Any]:
        data = real(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    with _PREPARE_LOCK:
        spawn.get_preparation_data = prepare
        try:
            yield
        finally:
            spawn.get_preparation_data = real


_PREPARE_LOCK = threading.Lock()


class _Pickler(pickle.Pickler):
    """Notes the modules the pickled objects' classes and functions come from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        try:
            module = getattr(obj, "__module__", None)
        except Exception:
            module = "__main__"  # unknown: assume the worst (the workers import the script)
        if isinstance(module, str):
            self.modules.add(module)
        return NotImplemented


def _dumps(fn: Any) -> tuple[bytes, frozenset[str]]:
    """(fn's pickle, the modules it names: `__main__` if something defined in the script)."""
    buf = io.BytesIO()
    p = _Pickler(buf, protocol=5)
    p.dump(fn)
    return buf.getvalue(), frozenset(p.modules)


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


class Processes:
    """Worker processes computing up to `depth` items ahead, handing arrays over shared memory.

    Args:
      workers: number of processes (default: the CPUs this process may use).
      depth: items in flight (default 2 per worker); bounds memory with the item size.
      start_method: 'forkserver' (default on POSIX), 'spawn' or 'fork'. Fork is fast but unsafe
        when the parent runs threads (JAX, ArrayRecord's reader pool); forkserver forks workers
        from a clean single-threaded server.
      timeout: seconds to wait for one result before declaring the workers stuck (None: forever,
        while still checking liveness every second).

    Exceptions raised by `fn` in a worker are re-raised in the consumer with their original type
    (the worker's traceback is chained); a worker that dies raises `WorkerError`.
    """

    #: Work is pickled to the workers (a Loader checks its operators pickle when it is built).
    pickles = True

    def __init__(self, workers: int | None = None, *, depth: int | None = None,
                 start_method: str | None = None, timeout: float | None = None) -> None:
        self.workers = check_positive_int(available_cores() if workers is None else workers, "processes(workers)")
        self.depth = check_positive_int(2 * self.workers if depth is None else depth, "processes(depth)")
        self.start_method = start_method or _default_start_method()
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(f"start method {self.start_method!r} is not available here; use one of "
                             f"{mp.get_all_start_methods()}")
        self.timeout = timeout
        self._workers: list[_Worker] = []
        self._pool = SlotPool()
        self._fn: Any = None
        self._fn_blob: bytes | None = None
        self._next_worker = 0
        self._generation = 0
        self._with_main = False  # whether the running workers imported the main module
        self._fn_modules: frozenset[str] = frozenset()  # the modules the function's pickle names
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"processes({self.workers}, depth={self.depth}, start_method={self.start_method!r})"

    def __getstate__(self) -> dict[str, Any]:
        """A runner pickles as its configuration; the copy starts its own workers when used."""
        return {"workers": self.workers, "depth": self.depth, "start_method": self.start_method,
                "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["workers"], depth=state["depth"],  # type: ignore[misc]
                      start_method=state["start_method"], timeout=state["timeout"])

    # --- lifecycle ------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first `imap` and after close)."""
        return [w.process.pid for w in self._workers]

    @property
    def segments(self) -> list[str]:
        """Names of the shared-memory segments currently allocated (for tests and debugging)."""
        return self._pool.names()

    def _start(self, modules: frozenset[str]) -> None:
        ctx: Any = mp.get_context(self.start_method)  # the stubs' BaseContext has no Process
        with_main = "__main__" in modules
        if self.start_method == "forkserver":
            # the modules the function needs are imported once, by the forkserver, when this
            # process first starts it (each worker importing them took 0.15-0.25 s); a module
            # that fails to import there is imported by the workers as before
            named = sorted(m for m in modules if m != "__main__" and m.split(".")[0] != "builtins")
            ctx.set_forkserver_preload(list(dict.fromkeys(["numpy", "zephon.runners", *named])))
        share = max(1, available_cores() // self.workers)  # each worker's native threads
        with contextlib.nullcontext() if with_main else _main_not_imported():
            for i in range(self.workers):
                parent, child = ctx.Pipe(duplex=True)  # a socketpair: it can carry descriptors
                proc = ctx.Process(target=worker_main, args=(child, i, os.getpid(), share, dict(os.environ)),
                                   daemon=True, name=f"zephon-worker-{i}")
                proc.start()
                child.close()
                self._workers.append(_Worker(proc, parent, fd_socket(parent)))
        self._with_main = with_main
        log.debug("%r started workers %s (main module imported: %s)", self, self.pids, with_main)

    def close(self) -> None:
        """Stops the workers (stop message, then SIGTERM, then SIGKILL) and releases every slot
        (its memory goes when the last array viewing it does)."""
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(encode(Stop()))
            except (OSError, ValueError):
                pass
        for w in workers:
            w.process.join(timeout=0.5)
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=2)
            w.conn.close()
            w.sock.close()
        self._pool.close()
        self._fn, self._fn_blob = None, None
        self._generation += 1
        if workers:
            log.debug("%r stopped workers %s", self, [w.process.pid for w in workers])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- mapping --------------------------------------------------------------------------------
    def imap(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
        """`fn(item)` for every item, in order. The function is pickled here (a clear
        `WorkerError` if it cannot be), once per function; workers start on first iteration."""
        if fn is not self._fn:
            try:
                blob, modules = _dumps(fn)
            except Exception as e:
                raise errors.function_unpicklable(e) from e
        else:
            blob, modules = self._fn_blob, self._fn_modules  # type: ignore[assignment]
        self._install(fn, blob)
        self._fn_modules = modules
        return self._results(iter(items), fn, blob, modules)

    def _install(self, fn: Callable[[Any], Any], blob: bytes) -> None:
        if fn is not self._fn:
            self._fn, self._fn_blob = fn, blob
            for w in self._workers:
                w.has_fn = False

    def _results(self, items: Iterator[Any], fn: Callable[[Any], Any], blob: bytes,
                 modules: frozenset[str]) -> Iterator[Any]:
        """One imap at a time: starting another abandons this one (its in-flight items are
        drained and discarded), and resuming an abandoned one raises."""
        if self._workers and "__main__" in modules and not self._with_main:
            self.close()  # workers started without the main module cannot load this function
        if not self._workers:
            self._start(modules)
        self._drain()
        self._install(fn, blob)  # another imap (or a close) may have come in between
        self._generation += 1
        generation = self._generation
        order: deque[_Worker] = deque()
        index = 0
        try:
            for item in itertools.islice(items, self.depth):
                order.append(self._submit(index, item))
                index += 1
            while order:
                if generation != self._generation:
                    raise RuntimeError("a newer imap() or close() on this runner abandoned this "
                                       "iterator; iterate one imap() at a time.")
                worker = order.popleft()
                result = self._receive(worker)
                nxt = next(items, END)
                if nxt is not END:
                    order.append(self._submit(index, nxt))
                    index += 1
                yield result
        except WorkerError:
            self.close()
            raise

    def _submit(self, index: int, item: Any) -> _Worker:
        """Sends `item` to the next worker (round-robin), lending it a free slot if there is one."""
        w = self._workers[self._next_worker]
        self._next_worker = (self._next_worker + 1) % len(self._workers)
        if not w.has_fn:
            self._send(w, SetFunction(self._fn_blob))  # type: ignore[arg-type]
            w.has_fn = True
        slot, fresh = self._pool.acquire(), self._pool.fresh_name()
        retired = tuple(self._pool.retired[w.retired_seen:])
        w.retired_seen = len(self._pool.retired)
        seen = min(x.retired_seen for x in self._workers)
        if seen:  # every worker was told: forget them (the list would grow for the whole run)
            del self._pool.retired[:seen]
            for x in self._workers:
                x.retired_seen -= seen
        w.mapped.difference_update(retired)
        lend = slot is not None and slot.name not in w.mapped
        w.inflight.append(_Task(index, slot, fresh))
        self._send(w, Run(item, slot.ref() if slot else None, fresh, retired, lend))
        if lend:
            assert slot is not None
            try:
                send_fd(w.sock, slot.fd)
            except OSError as e:
                raise self._death(w, "accepting work") from e
            w.mapped.add(slot.name)
        return w

    def _send(self, w: _Worker, msg: Request) -> None:
        try:
            w.conn.send(encode(msg))
        except (BrokenPipeError, OSError) as e:
            raise self._death(w, "accepting work") from e

    def _receive(self, w: _Worker) -> Any:
        """The next reply of worker `w`, waiting on its pipe and on every worker's liveness."""
        task = w.inflight[0]
        waited = 0.0
        fd = None
        while True:
            ready = mpc.wait([w.conn] + [x.process.sentinel for x in self._workers], _POLL_SECONDS)
            if w.conn in ready:
                try:
                    msg = decode(w.conn.recv())
                    assert isinstance(msg, (Done, Failed)), msg
                    if isinstance(msg, Done) and msg.created:  # a new segment: its descriptor follows
                        fd = recv_fd(w.sock)
                        w.mapped.add(msg.slot)  # type: ignore[arg-type]
                except (EOFError, OSError) as e:
                    raise self._death(w, f"computing item {task.index}") from e
                break
            for x in self._workers:
                if not x.process.is_alive():
                    raise self._death(x, f"computing item {task.index}" if x is w else "running")
            waited += _POLL_SECONDS if not ready else 0.0
            if self.timeout is not None and waited >= self.timeout:
                raise errors.worker_stuck(self._workers.index(w), w.process.pid, task.index,
                                          self.timeout)
        w.inflight.popleft()
        return self._unpack(msg, task, fd)

    def _unpack(self, msg: Done | Failed, task: _Task, fd: int | None) -> Any:
        if isinstance(msg, Failed):
            self._pool.release(task.slot)
            errors.raise_failure(msg)
        buffers = self._pool.unpack(msg, task.slot, fd)
        try:
            return pickle.loads(msg.payload, buffers=buffers)
        except Exception as e:
            raise errors.result_unpicklable(task.index, e) from e

    def _drain(self) -> None:
        """Receives and discards results of items an abandoned `imap` left in flight."""
        for w in self._workers:
            while w.inflight:
                try:
                    self._receive(w)
                except WorkerError:
                    self.close()
                    raise
                except Exception:
                    pass

    def _death(self, w: _Worker, doing: str) -> WorkerError:
        w.process.join(timeout=1)
        index = self._workers.index(w) if w in self._workers else -1
        error = errors.worker_died(index, w.process.pid, w.process.exitcode, doing)
        log.debug("%s", error)
        return error

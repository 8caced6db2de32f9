"""Runners execute a pure function over items, in order; they change speed, never data.

A runner offers `imap(fn, items)`: the results of `fn(item)` in item order, computed ahead of the
consumer with a bounded number of items in flight (`depth`), so memory is bounded by the depth and
never by the data set. Because `fn` is pure (the loader's step task: plan + sources + transforms),
which thread or process computes a result cannot change it; that is what lets the runner and the
worker count be chosen for speed alone.

- `inline()`: in the consumer's thread, when asked for. No parallelism, no prefetch.
- `threads(n)`: a thread pool. Sources whose bulk reads release the GIL (ArrayRecord's C++ reader,
  pyarrow, large numpy operations) overlap; Python work does not.
- `processes(n)`: worker processes (forkserver by default: no fork of a threaded parent). Each
  worker receives the pickled function once, then only items; results come back as a small pickle
  (protocol 5) whose array buffers the worker wrote into a shared-memory slot, so arrays never go
  through a pipe. The arrays handed to the consumer are views of the slot, and a slot is
  reused only after every array viewing it has been garbage collected, so batches a caller keeps
  are never overwritten. A worker that dies raises `WorkerError` in the consumer (the consumer
  waits on the workers' process sentinels, never on a bare blocking get), and `close()`,
  garbage collection and interpreter exit terminate the workers and release every slot.

Shared memory has no name: a slot is an anonymous memory file (`memfd_create`; elsewhere a POSIX
segment unlinked the instant it is created) whose descriptor travels over the worker's socket
(SCM_RIGHTS). Nothing is ever left in /dev/shm, whatever kills the consumer or the workers
(SIGKILL, the OOM killer, a whole process group killed): the kernel frees a slot's memory when the
last process mapping it ends. Workers also watch the consumer (a pidfd) and exit as soon as it
dies, so orphaned workers do not keep their slots alive.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import select
import signal
import socket
import threading
import traceback
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np

from zephon.errors import WorkerError

log = logging.getLogger(__name__)

_ALIGN = 64                  # byte alignment of every array in a slot (cache line, SIMD loads)
_INBAND_MAX = 4096           # buffers smaller than this travel inside the pickle
_POLL_SECONDS = 1.0          # upper bound between liveness checks while waiting for a worker
_END = object()


def available_cores() -> int:
    """CPUs this process may run on (respects affinity masks and cgroup-pinned CPU sets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class Runner(Protocol):
    def imap(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]: ...

    def close(self) -> None: ...


# --- inline -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Inline:
    """Runs each item in the consumer's thread when it is asked for."""

    def imap(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        return map(fn, items)

    def close(self) -> None:
        """Nothing to release."""


# --- threads ------------------------------------------------------------------------------------
class Threads:
    """A thread pool computing up to `depth` items ahead of the consumer, yielded in order.

    An exception raised by `fn` is re-raised in the consumer unchanged (same type as inline).
    """

    def __init__(self, workers: int | None = None, *, depth: int | None = None) -> None:
        self.workers = _positive("threads(workers)", available_cores() if workers is None else workers)
        self.depth = _positive("threads(depth)", 2 * self.workers if depth is None else depth)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"threads({self.workers}, depth={self.depth})"

    def __getstate__(self) -> dict[str, Any]:
        """A runner pickles as its configuration; the copy makes its own pool when used."""
        return {"workers": self.workers, "depth": self.depth}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["workers"], depth=state["depth"])

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="zephon")
            return self._pool

    def imap(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        pool = self._executor()
        source = iter(items)
        window: deque[Future[Any]] = deque(pool.submit(fn, item)
                                           for item in itertools.islice(source, self.depth))
        try:
            while window:
                result = window.popleft().result()
                nxt = next(source, _END)
                if nxt is not _END:
                    window.append(pool.submit(fn, nxt))
                yield result
        finally:
            for fut in window:
                fut.cancel()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# --- shared-memory slots ------------------------------------------------------------------------
def _anonymous_segment(label: str, size: int) -> int:
    """A descriptor of `size` bytes of shared memory that has no name anyone could leak.

    Linux: `memfd_create` (the label only shows in /proc/<pid>/maps). Elsewhere: a POSIX segment
    unlinked right after it is created, through `_posixshmem`, the private CPython binding of
    shm_open/shm_unlink that `multiprocessing.shared_memory` itself uses (the public
    `SharedMemory` cannot unlink a segment it keeps open, and registers it with the resource
    tracker). Only a SIGKILL between those two calls, in the creating process, could leave a name.
    """
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(label, getattr(os, "MFD_CLOEXEC", 0))
    else:  # pragma: no cover - macOS and other POSIX systems without memfd
        import _posixshmem

        fd = _posixshmem.shm_open("/" + label, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=0o600)
        _posixshmem.shm_unlink("/" + label)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_fd(fd: int, size: int) -> mmap.mmap:
    """Maps a segment's descriptor, then closes it (the mapping keeps the memory alive)."""
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _fd_socket(conn: mpc.Connection) -> socket.socket:
    """A socket object over a duplex Pipe's socketpair end, for passing descriptors."""
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))


def _send_fd(sock: socket.socket, fd: int) -> None:
    socket.send_fds(sock, [b"F"], [fd])


def _recv_fd(sock: socket.socket) -> int:
    """The next descriptor on `sock`; EOFError when the peer is gone."""
    data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not fds:
        raise EOFError("the peer closed the connection before sending a shared-memory descriptor")
    for extra in fds[1:]:
        os.close(extra)
    os.set_inheritable(fds[0], False)  # a subprocess must not keep the memory alive
    return fds[0]


def _slot_size(needed: int) -> int:
    """Room for `needed` bytes plus 1/8 headroom (results of one function vary a little)."""
    return -(-(needed + needed // 8) // mmap.PAGESIZE) * mmap.PAGESIZE


@dataclass(eq=False)
class _Slot:
    name: str
    size: int
    mm: mmap.mmap
    fd: int  # kept open to lend the slot to a worker that has not mapped it yet
    dead: bool = False  # destroyed: when its last view dies, its memory goes, it is not reused


def _return_slot(returned: deque[_Slot], slot: _Slot) -> None:
    """A slot's last view died (any thread): queue it for reuse, unless the pool dropped it."""
    if not slot.dead:
        returned.append(slot)


class _SlotPool:
    """The consumer's shared-memory segments: lent to workers, reused, and unlinked at close.

    A worker whose result does not fit the slot it was lent (or that was lent none) creates a
    segment under a fresh name the consumer chose, and the consumer adopts it; so slots are sized
    by the results themselves and nothing travels through the pipe. A slot comes back when the
    last array viewing it is garbage collected (`weakref.finalize` on the per-use holder array
    every result array is based on), so a batch the caller keeps is never overwritten. The
    finalizer, which may run in any thread, only queues the slot; the pool itself is changed in
    the consumer's thread alone. Slots are anonymous (see `_anonymous_segment`): their memory
    goes with the last process that maps them, so no death of any process leaves one behind.
    """

    def __init__(self) -> None:
        self.prefix = f"zephon-{os.getpid()}-{secrets.token_hex(3)}"
        self._slots: dict[str, _Slot] = {}
        self._free: list[_Slot] = []
        self._returned: deque[_Slot] = deque()  # appended by finalizers (atomic)
        self._needed = 0                         # largest slot a result needed, in bytes
        self._counter = itertools.count()
        self.retired: list[str] = []             # destroyed slots workers should unmap

    def names(self) -> list[str]:
        return list(self._slots)

    def fresh_name(self) -> str:
        return f"{self.prefix}-{next(self._counter)}"

    def acquire(self) -> _Slot | None:
        """A free slot (the largest), or None: the worker then makes one of the right size."""
        self._collect()
        if not self._free:
            return None
        best = max(range(len(self._free)), key=lambda i: self._free[i].size)
        return self._free.pop(best)

    def adopt(self, name: str, size: int, fd: int) -> _Slot:
        """Takes ownership of a segment a worker created for us (and sent the descriptor of)."""
        try:
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        slot = _Slot(name, size, mm, fd)
        self._slots[name] = slot
        self._needed = max(self._needed, size)
        return slot

    def release(self, slot: _Slot) -> None:
        if self._slots.get(slot.name) is not slot:
            return  # already destroyed (pool closed)
        if slot.size < self._needed:
            self._destroy(slot)  # too small for today's results
        else:
            self._free.append(slot)

    def view(self, slot: _Slot) -> np.ndarray:
        """A fresh holder array over the slot; the slot comes back when it (and views) die."""
        holder = np.frombuffer(slot.mm, dtype=np.uint8)
        weakref.finalize(holder, _return_slot, self._returned, slot)
        return holder

    def _collect(self) -> None:
        while self._returned:
            self.release(self._returned.popleft())

    def _destroy(self, slot: _Slot) -> None:
        slot.dead = True
        del self._slots[slot.name]
        self.retired.append(slot.name)
        os.close(slot.fd)
        try:
            slot.mm.close()
        except BufferError:
            pass  # a caller still holds arrays on it; the mapping goes when they do

    def close(self) -> None:
        self._returned.clear()
        for slot in list(self._slots.values()):
            self._destroy(slot)
        self._free.clear()
        self.retired.clear()


# --- worker side --------------------------------------------------------------------------------
def _pack(result: Any, slot: tuple[str, int] | None, fresh: str,
          maps: dict[str, mmap.mmap]) -> tuple[tuple[Any, ...], int | None]:
    """Pickles `result` with its large array buffers placed in shared memory (protocol 5, out of
    band): in `slot` if they fit, else in a new segment labelled `fresh`, whose descriptor is
    returned with the reply for the caller to send after it."""
    buffers: list[memoryview] = []

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < _INBAND_MAX:
            return True
        buffers.append(raw)
        return False

    payload = pickle.dumps(result, protocol=5, buffer_callback=out_of_band)
    if not buffers:
        return ("ok", payload, (), None, 0), None
    spans, offset = [], 0
    for raw in buffers:
        spans.append((offset, raw.nbytes))
        offset += -(-raw.nbytes // _ALIGN) * _ALIGN
    fd = None
    if slot is not None and slot[1] >= offset:
        name, created = slot[0], 0
        mm = maps[name]  # the consumer sent its descriptor before lending it to us
    else:
        name, created = fresh, _slot_size(offset)
        fd = _anonymous_segment(name, created)
        try:
            mm = mmap.mmap(fd, created)
        except BaseException:
            os.close(fd)
            raise
        maps[name] = mm
    for (start, nbytes), raw in zip(spans, buffers):
        mm[start:start + nbytes] = raw
    return ("ok", payload, tuple(spans), name, created), fd


def _picklable_error(exc: BaseException) -> bytes | None:
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
        return blob
    except Exception:  # noqa: BLE001 - an unpicklable exception travels as text only
        return None


def _watch_consumer(pid: int) -> None:
    """Ends this worker the moment the consumer process ends, whatever it is doing.

    The consumer's end of the pipe closing also ends an idle worker, but a worker busy with a
    long item would otherwise run on (holding its memory) until it next talks to the pipe.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): the pipe's EOF still ends us
        return
    select.select([fd], [], [])
    os._exit(0)


def _worker_main(conn: mpc.Connection, index: int, consumer: int | None = None) -> None:
    """A worker: receives the function once, then items; replies in order on its own pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    if consumer is not None:
        threading.Thread(target=_watch_consumer, args=(consumer,), daemon=True,
                         name="zephon-watch-consumer").start()
    fn: Callable[[Any], Any] | None = None
    fn_error: BaseException | None = None
    maps: dict[str, mmap.mmap] = {}
    sock = _fd_socket(conn)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the consumer is gone
        if msg[0] == "stop":
            return
        if msg[0] == "fn":
            try:
                fn, fn_error = pickle.loads(msg[1]), None
            except BaseException as e:  # noqa: BLE001 - reported with every task instead
                fn, fn_error = None, e
            continue
        _, item, slot, fresh, retired, lent = msg
        for name in retired:
            old = maps.pop(name, None)
            if old is not None:
                old.close()
        if lent:  # the descriptor of a slot we have not mapped follows the message
            try:
                maps[slot[0]] = _map_fd(_recv_fd(sock), slot[1])
            except (EOFError, OSError):
                return
        fd = None
        try:
            if fn_error is not None:
                raise fn_error
            reply, fd = _pack(fn(item), slot, fresh, maps)  # type: ignore[misc]
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the consumer
            reply = ("err", _picklable_error(e), f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            conn.send(reply)
            if fd is not None:
                _send_fd(sock, fd)
        except (BrokenPipeError, OSError):
            return
        finally:
            if fd is not None:
                os.close(fd)  # our mapping (in `maps`) keeps the memory


# --- processes ----------------------------------------------------------------------------------
class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in a worker process (chained as cause)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb}\"\"\""


@dataclass(eq=False)
class _Task:
    index: int
    slot: _Slot | None
    fresh: str  # the name the worker creates a segment under if `slot` is too small


@dataclass(eq=False)
class _Worker:
    process: Any
    conn: mpc.Connection
    sock: socket.socket  # the same socketpair end as `conn`, for descriptors
    inflight: deque[_Task] = field(default_factory=deque)
    has_fn: bool = False
    retired_seen: int = 0
    mapped: set[str] = field(default_factory=set)  # slots this worker has mapped


_LIVE: "weakref.WeakSet[Processes]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for runner in list(_LIVE):
        runner.close()


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


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

    def __init__(self, workers: int | None = None, *, depth: int | None = None,
                 start_method: str | None = None, timeout: float | None = None) -> None:
        self.workers = _positive("processes(workers)", available_cores() if workers is None else workers)
        self.depth = _positive("processes(depth)", 2 * self.workers if depth is None else depth)
        self.start_method = start_method or _default_start_method()
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(f"start method {self.start_method!r} is not available here; use one of "
                             f"{mp.get_all_start_methods()}")
        self.timeout = timeout
        self._workers: list[_Worker] = []
        self._pool = _SlotPool()
        self._fn: Any = None
        self._fn_blob: bytes | None = None
        self._next_worker = 0
        self._generation = 0
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"processes({self.workers}, depth={self.depth}, start_method={self.start_method!r})"

    def __getstate__(self) -> dict[str, Any]:
        """A runner pickles as its configuration; the copy starts its own workers when used."""
        return {"workers": self.workers, "depth": self.depth, "start_method": self.start_method,
                "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["workers"], depth=state["depth"], start_method=state["start_method"],
                      timeout=state["timeout"])

    # --- lifecycle ------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first `imap` and after close)."""
        return [w.process.pid for w in self._workers]

    @property
    def segments(self) -> list[str]:
        """Names of the shared-memory segments currently allocated (for tests and debugging)."""
        return self._pool.names()

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(["numpy", "zephon.runners"])
        for i in range(self.workers):
            parent, child = ctx.Pipe(duplex=True)  # a socketpair: it can carry descriptors
            proc = ctx.Process(target=_worker_main, args=(child, i, os.getpid()), daemon=True,
                               name=f"zephon-worker-{i}")
            proc.start()
            child.close()
            self._workers.append(_Worker(proc, parent, _fd_socket(parent)))
        log.debug("%r started workers %s", self, self.pids)

    def close(self) -> None:
        """Stops the workers (stop message, then SIGTERM, then SIGKILL) and releases every slot
        (its memory goes when the last array viewing it does)."""
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(("stop",))
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

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- mapping --------------------------------------------------------------------------------
    def imap(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        if fn is not self._fn:
            try:
                blob = pickle.dumps(fn, protocol=5)
            except Exception as e:
                raise WorkerError(f"the function for worker processes cannot be pickled ({e!r}); "
                                  "define transforms and sources at module level (no lambdas or "
                                  "closures), or use threads() instead of processes().") from e
        else:
            blob = self._fn_blob  # type: ignore[assignment]
        self._install(fn, blob)
        return self._results(iter(items), fn, blob)

    def _install(self, fn: Callable[[Any], Any], blob: bytes) -> None:
        if fn is not self._fn:
            self._fn, self._fn_blob = fn, blob
            for w in self._workers:
                w.has_fn = False

    def _results(self, items: Iterator[Any], fn: Callable[[Any], Any], blob: bytes) -> Iterator[Any]:
        """One imap at a time: starting another abandons this one (its in-flight items are
        drained and discarded), and resuming an abandoned one raises."""
        if not self._workers:
            self._start()
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
                nxt = next(items, _END)
                if nxt is not _END:
                    order.append(self._submit(index, nxt))
                    index += 1
                yield result
        except WorkerError:
            self.close()
            raise

    def _submit(self, index: int, item: Any) -> _Worker:
        w = self._workers[self._next_worker]
        self._next_worker = (self._next_worker + 1) % len(self._workers)
        if not w.has_fn:
            self._send(w, ("fn", self._fn_blob))
            w.has_fn = True
        slot, fresh = self._pool.acquire(), self._pool.fresh_name()
        retired = self._pool.retired[w.retired_seen:]
        w.retired_seen = len(self._pool.retired)
        w.mapped.difference_update(retired)
        lend = slot is not None and slot.name not in w.mapped
        w.inflight.append(_Task(index, slot, fresh))
        self._send(w, ("task", item, (slot.name, slot.size) if slot else None, fresh, retired, lend))
        if lend:
            try:
                _send_fd(w.sock, slot.fd)  # type: ignore[union-attr]
            except OSError as e:
                raise self._death(w, "accepting work") from e
            w.mapped.add(slot.name)  # type: ignore[union-attr]
        return w

    def _send(self, w: _Worker, msg: tuple[Any, ...]) -> None:
        try:
            w.conn.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise self._death(w, "accepting work") from e

    def _receive(self, w: _Worker) -> Any:
        """The next reply of worker `w`, waiting on its pipe and on every worker's liveness."""
        task = w.inflight[0]
        waited = 0.0
        while True:
            ready = mpc.wait([w.conn] + [x.process.sentinel for x in self._workers], _POLL_SECONDS)
            if w.conn in ready:
                try:
                    msg = w.conn.recv()
                    if msg[0] == "ok" and msg[4]:  # a new segment: its descriptor follows
                        fd = _recv_fd(w.sock)
                        msg = (*msg, fd)
                        w.mapped.add(msg[3])
                except (EOFError, OSError) as e:
                    raise self._death(w, f"computing item {task.index}") from e
                break
            for x in self._workers:
                if not x.process.is_alive():
                    raise self._death(x, f"computing item {task.index}" if x is w else "running")
            waited += _POLL_SECONDS if not ready else 0.0
            if self.timeout is not None and waited >= self.timeout:
                raise WorkerError(f"worker {self._workers.index(w)} (pid {w.process.pid}) gave no "
                                  f"result for item {task.index} in {self.timeout:.0f} s; it is stuck "
                                  "(a deadlock or an endless transform). Fix the transform or raise "
                                  "the runner's timeout.")
        w.inflight.popleft()
        return self._unpack(msg, task)

    def _unpack(self, msg: tuple[Any, ...], task: _Task) -> Any:
        if msg[0] == "ok":
            _, payload, spans, name, created, *fd = msg
            if not spans:
                self._give_back(task.slot)
                return self._loads(payload, task)
            if created:
                slot = self._pool.adopt(name, created, fd[0])
                self._give_back(task.slot)
            else:
                slot = task.slot  # type: ignore[assignment]
            holder = self._pool.view(slot)
            return self._loads(payload, task, [holder[o:o + n] for o, n in spans])
        self._give_back(task.slot)
        _, blob, summary, tb = msg
        remote = RemoteTraceback(tb)
        if blob is not None:
            raise pickle.loads(blob) from remote
        raise WorkerError(f"a worker raised {summary} (the exception could not be pickled back); "
                          "see the worker traceback above.") from remote

    @staticmethod
    def _loads(payload: bytes, task: _Task, buffers: list[Any] | None = None) -> Any:
        try:
            return pickle.loads(payload, buffers=buffers)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is the same problem
            raise WorkerError(f"the result of item {task.index} came back from a worker but cannot "
                              f"be unpickled here ({type(e).__name__}: {e}). Results must be "
                              "made of types this process can import (numpy arrays, dicts, "
                              "module-level classes).") from e

    def _give_back(self, slot: _Slot | None) -> None:
        if slot is not None:
            self._pool.release(slot)

    def _drain(self) -> None:
        """Receives and discards results of items an abandoned `imap` left in flight."""
        for w in self._workers:
            while w.inflight:
                try:
                    self._receive(w)
                except WorkerError:
                    self.close()
                    raise
                except Exception:  # noqa: BLE001 - the consumer no longer wants this result
                    pass

    def _death(self, w: _Worker, doing: str) -> WorkerError:
        w.process.join(timeout=1)
        i = self._workers.index(w) if w in self._workers else -1
        code = w.process.exitcode
        if code is not None and code > 0:
            cause = ("It exited on its own: usually an error while starting it (its traceback is "
                     "on stderr), e.g. a main module without an `if __name__ == '__main__':` "
                     "guard, which worker processes re-import.")
        else:
            cause = ("This is usually the kernel's out-of-memory killer (SIGKILL) or a crash in "
                     "native code; if memory ran out, use fewer workers or a smaller depth.")
        return WorkerError(
            f"worker process {i} (pid {w.process.pid}) died with {_describe_exit(code)} while "
            f"{doing}; its results are lost. {cause} The loader's state is unchanged: fix the "
            "cause, then iterate again or resume from the last saved state.")


# --- constructors -------------------------------------------------------------------------------
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


def _positive(what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value

"""The worker process's side of `processes(n)`: receive the function once, then items; reply in order.

This is all the code that runs in a worker (besides the function itself): it is what the
forkserver preloads (`zephon.runners`), and it touches no consumer state. Each worker serves one
duplex pipe: `SetFunction`, then `Run` after `Run`, each answered by exactly one `Done` or
`Failed`, in order (see `zephon.runners.messages`). A worker never decides anything on its own:
slots are lent and retired by the consumer, and a worker only maps, fills and unmaps them.

A worker ends when told (`Stop`), when its pipe closes, or — even in the middle of a long item —
the moment the consumer process ends (`_watch_consumer`), so an orphaned worker never keeps its
memory alive.
"""

from __future__ import annotations

import mmap
import multiprocessing.connection as mpc
import os
import pickle
import select
import signal
import threading
from collections.abc import Callable
from typing import Any

from zephon.runners.errors import failure
from zephon.runners.messages import Done, Failed, Run, SetFunction, Stop, decode, encode
from zephon.runners.transport import fd_socket, map_fd, pack, recv_fd, send_fd


def worker_main(conn: mpc.Connection, index: int, consumer: int | None = None,
                native_threads: int | None = None, environ: dict[str, str] | None = None) -> None:
    """A worker's life: serve `conn` until told to stop or the consumer is gone.

    `environ`: the consumer's environment when it started the worker. A fork server's children
    inherit the fork server's, frozen when it first started: without this, a worker would use an
    object-store endpoint or credential the consumer has since changed (seen in the test suite:
    a fork server started under one test's SeaweedFS sent later tests' workers to it after it
    had stopped).

    `native_threads`: the cores this worker's share is; native thread pools (Rust `tokenizers`'
    rayon pool) are sized to it, so that n workers do not each spin a pool as large as the
    machine (measured: two workers with a two-thread pool each ran Tokenize at 1.7M tokens/s,
    with one thread each at 2.8M, on two cores).
    """
    if environ is not None and environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    if native_threads is not None:
        _limit_native_threads(native_threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    if consumer is not None:
        threading.Thread(target=_watch_consumer, args=(consumer,), daemon=True,
                         name="zephon-watch-consumer").start()
    fn: Callable[[Any], Any] | None = None
    fn_error: BaseException | None = None
    maps: dict[str, mmap.mmap] = {}  # the slots this worker has mapped, by name
    sock = fd_socket(conn)
    while True:
        try:
            msg = decode(conn.recv())
        except (EOFError, OSError):
            return  # the consumer is gone
        if isinstance(msg, Stop):
            return
        if isinstance(msg, SetFunction):
            try:
                fn, fn_error = pickle.loads(msg.blob), None
            except BaseException as e:
                fn, fn_error = None, e
            continue
        assert isinstance(msg, Run), msg
        for name in msg.retired:
            old = maps.pop(name, None)
            if old is not None:
                old.close()
        if msg.lend:  # the descriptor of a slot we have not mapped follows the message
            assert msg.slot is not None
            try:
                maps[msg.slot.name] = map_fd(recv_fd(sock), msg.slot.size)
            except (EOFError, OSError):
                return
        fd = None
        reply: Done | Failed
        try:
            if fn_error is not None:
                raise fn_error
            reply, fd = pack(fn(msg.item), msg.slot, msg.fresh, maps)  # type: ignore[misc]
        except BaseException as e:
            reply = failure(e)
        try:
            conn.send(encode(reply))
            if fd is not None:
                send_fd(sock, fd)
        except (BrokenPipeError, OSError):
            return
        finally:
            if fd is not None:
                os.close(fd)  # our mapping (in `maps`) keeps the memory


def _limit_native_threads(n: int) -> None:
    """Sizes the native thread pools this process may start (read when they start)."""
    os.environ["RAYON_NUM_THREADS"] = str(n)
    if n == 1:  # `tokenizers` then encodes in the calling thread, without its pool
        os.environ["TOKENIZERS_PARALLELISM"] = "false"


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

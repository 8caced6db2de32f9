"""Shared-memory transport: results' arrays cross from worker to consumer without a pipe or a copy.

A worker pickles its result with protocol 5, out of band: array buffers of `INBAND_MAX` bytes or
more are written into a shared-memory *slot* (`pack`), and only the small pickle and the buffers'
spans travel over the pipe (`Done`). The consumer unpickles onto views of the slot
(`SlotPool.unpack`), so the arrays handed to the caller are the worker's bytes, in place.

Slots are pooled by the consumer (`SlotPool`) and lent to workers; a slot comes back for reuse
only when every array viewing it has been garbage collected, so batches a caller keeps are never
overwritten. A worker whose result does not fit the slot it was lent (or that was lent none)
creates a segment of the right size, under a name the consumer chose, and passes its descriptor
back; so slots are sized by the results themselves.

Shared memory has no name: a slot is an anonymous memory file (`memfd_create`; elsewhere a POSIX
segment unlinked the instant it is created) whose descriptor travels over the worker's socket
(SCM_RIGHTS). Nothing is ever left in /dev/shm, whatever kills the consumer or the workers
(SIGKILL, the OOM killer, a whole process group killed): the kernel frees a slot's memory when the
last process mapping it ends.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import mmap
import multiprocessing.connection as mpc
import os
import pickle
import secrets
import socket
import tempfile
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.runners.messages import Done, SlotRef

log = logging.getLogger(__name__)

ALIGN = 64          # byte alignment of every array in a slot (cache line, SIMD loads)
INBAND_MAX = 4096   # buffers smaller than this travel inside the pickle


# --- segments and descriptors ------------------------------------------------------------------
def anonymous_segment(label: str, size: int, *, kind: str | None = None) -> int:
    """A descriptor of `size` bytes of shared memory that has no name anyone could leak.

    `kind` (default: the first available, in this order):
    - 'memfd' (Linux): `memfd_create`; the label only shows in /proc/<pid>/maps.
    - 'posix' (macOS, other POSIX): a POSIX shared-memory segment, unlinked right after it is
      created. This is the one use of a private CPython module, `_posixshmem`: the binding of
      shm_open/shm_unlink that `multiprocessing.shared_memory` itself is built on. The public
      `SharedMemory` class cannot serve: it does not hand out its descriptor (a private `_fd`),
      cannot unlink a segment while keeping it open without also unregistering it, and registers
      every segment with the resource tracker. Only a SIGKILL between the two calls, in the creating
      process, could leave a name behind.
    - 'file': an unlinked temporary file (public API only; used when neither of the above exists,
      e.g. an interpreter without `_posixshmem`). Same sharing semantics, but the memory may be
      backed by a disk file system, so the kernel may write pages back.
    """
    kind = kind or _default_kind()
    if kind == "memfd":
        fd = os.memfd_create(label, getattr(os, "MFD_CLOEXEC", 0))
    elif kind == "posix":
        import _posixshmem  # private, see above

        fd = _posixshmem.shm_open("/" + label, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode=0o600)
        _posixshmem.shm_unlink("/" + label)
    elif kind == "file":
        with tempfile.TemporaryFile(prefix=label) as f:  # unlinked (or O_TMPFILE) from the start
            fd = os.dup(f.fileno())  # not inheritable, like every descriptor Python makes
    else:
        raise ValueError(f"unknown shared-memory kind {kind!r}; use 'memfd', 'posix' or 'file'")
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


@functools.cache
def _default_kind() -> str:
    if hasattr(os, "memfd_create"):
        return "memfd"
    return "posix" if importlib.util.find_spec("_posixshmem") else "file"  # pragma: no cover


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Maps a segment's descriptor, then closes it (the mapping keeps the memory alive)."""
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def fd_socket(conn: mpc.Connection) -> socket.socket:
    """A socket object over a duplex Pipe's socketpair end, for passing descriptors."""
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))


def send_fd(sock: socket.socket, fd: int) -> None:
    """Sends one descriptor (SCM_RIGHTS); the receiver gets its own copy of it."""
    socket.send_fds(sock, [b"F"], [fd])


def recv_fd(sock: socket.socket) -> int:
    """The next descriptor on `sock`; EOFError when the peer is gone."""
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not fds:
        raise EOFError("the peer closed the connection before sending a shared-memory descriptor")
    for extra in fds[1:]:
        os.close(extra)
    os.set_inheritable(fds[0], False)  # a subprocess must not keep the memory alive
    return fds[0]


def slot_size(needed: int) -> int:
    """Room for `needed` bytes plus 1/8 headroom (results of one function vary a little)."""
    return -(-(needed + needed // 8) // mmap.PAGESIZE) * mmap.PAGESIZE


# --- worker side -------------------------------------------------------------------------------
def pack(result: Any, slot: SlotRef | None, fresh: str,
         maps: dict[str, mmap.mmap]) -> tuple[Done, int | None]:
    """Pickles `result` with its large array buffers placed in shared memory (protocol 5, out of
    band): in `slot` if they fit, else in a new segment labelled `fresh`, whose descriptor is
    returned with the reply for the caller to send after it. `maps`: the worker's mappings, by
    slot name (a new segment is added to it)."""
    buffers: list[memoryview] = []

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < INBAND_MAX:
            return True
        buffers.append(raw)
        return False

    payload = pickle.dumps(result, protocol=5, buffer_callback=out_of_band)
    if not buffers:
        return Done(payload), None
    spans, offset = [], 0
    for raw in buffers:
        spans.append((offset, raw.nbytes))
        offset += -(-raw.nbytes // ALIGN) * ALIGN
    fd = None
    if slot is not None and slot.size >= offset:
        name, created = slot.name, 0
        mm = maps[name]  # the consumer sent its descriptor before lending it to us
    else:
        name, created = fresh, slot_size(offset)
        fd = anonymous_segment(name, created)
        try:
            mm = mmap.mmap(fd, created)
        except BaseException:
            os.close(fd)
            raise
        maps[name] = mm
    for (start, nbytes), raw in zip(spans, buffers):
        mm[start:start + nbytes] = raw
    return Done(payload, tuple(spans), name, created), fd


# --- consumer side -----------------------------------------------------------------------------
@dataclass(eq=False)
class Slot:
    """A segment the consumer owns: mapped here, lendable to workers by descriptor."""

    name: str
    size: int
    mm: mmap.mmap
    fd: int  # kept open to lend the slot to a worker that has not mapped it yet
    dead: bool = False  # destroyed: when its last view dies, its memory goes, it is not reused

    def ref(self) -> SlotRef:
        return SlotRef(self.name, self.size)


def _return_slot(returned: deque[Slot], slot: Slot) -> None:
    """A slot's last view died (any thread): queue it for reuse, unless the pool dropped it."""
    if not slot.dead:
        returned.append(slot)


class SlotPool:
    """The consumer's shared-memory segments: lent to workers, reused, and released at close.

    A slot comes back when the last array viewing it is garbage collected (`weakref.finalize` on
    the per-use holder array every result array is based on), so a batch the caller keeps is never
    overwritten. The finalizer, which may run in any thread, only queues the slot; the pool itself
    is changed in the consumer's thread alone. Slots are anonymous (see `anonymous_segment`): their
    memory goes with the last process that maps them, so no death of any process leaves one behind.
    """

    def __init__(self) -> None:
        self.prefix = f"zephon-{os.getpid()}-{secrets.token_hex(3)}"
        self._slots: dict[str, Slot] = {}
        self._free: list[Slot] = []
        self._returned: deque[Slot] = deque()  # appended by finalizers (atomic)
        self._needed = 0                        # largest result a slot had to hold, in bytes
        self._counter = itertools.count()
        self.retired: list[str] = []            # destroyed slots workers should unmap

    def names(self) -> list[str]:
        return list(self._slots)

    def fresh_name(self) -> str:
        return f"{self.prefix}-{next(self._counter)}"

    def acquire(self) -> Slot | None:
        """A free slot (the largest), or None: the worker then makes one of the right size."""
        self._collect()
        if not self._free:
            return None
        best = max(range(len(self._free)), key=lambda i: self._free[i].size)
        return self._free.pop(best)

    def adopt(self, name: str, size: int, fd: int) -> Slot:
        """Takes ownership of a segment a worker created for us (and sent the descriptor of)."""
        try:
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        slot = Slot(name, size, mm, fd)
        self._slots[name] = slot
        # what the result needed, without the headroom `slot_size` added: a slot keeps being
        # reused while it holds the largest result seen, instead of being replaced whenever a
        # window a few bytes larger arrives (filter windows vary by ~1 %)
        self._needed = max(self._needed, size * 8 // 9)
        log.debug("adopted shared-memory slot %s (%d bytes; %d slots)", name, size, len(self._slots))
        return slot

    def release(self, slot: Slot | None) -> None:
        """Back to the free list (or destroyed, if smaller than results now need)."""
        if slot is None or self._slots.get(slot.name) is not slot:
            return  # none lent, or already destroyed (pool closed)
        if slot.size < self._needed:
            self._destroy(slot)  # too small for today's results
        else:
            self._free.append(slot)

    def unpack(self, done: Done, lent: Slot | None, fd: int | None) -> list[np.ndarray] | None:
        """The out-of-band buffers of `done` as views of its slot (None: it used none), settling
        the slots: the one the worker created (descriptor `fd`) is adopted, and the lent one
        released unless the buffers lie in it (then it returns when the views die)."""
        if not done.spans:
            self.release(lent)
            return None
        if done.created:
            assert done.slot is not None and fd is not None
            slot = self.adopt(done.slot, done.created, fd)
            self.release(lent)  # after adopt: the new size decides whether `lent` is kept
        else:
            assert lent is not None and lent.name == done.slot
            slot = lent
        holder = self._view(slot)
        return [holder[o:o + n] for o, n in done.spans]

    def _view(self, slot: Slot) -> np.ndarray:
        """A fresh holder array over the slot; the slot comes back when it (and views) die."""
        holder = np.frombuffer(slot.mm, dtype=np.uint8)
        weakref.finalize(holder, _return_slot, self._returned, slot)
        return holder

    def _collect(self) -> None:
        while self._returned:
            self.release(self._returned.popleft())

    def _destroy(self, slot: Slot) -> None:
        slot.dead = True
        del self._slots[slot.name]
        self.retired.append(slot.name)
        os.close(slot.fd)
        try:
            slot.mm.close()
        except BufferError:
            pass  # a caller still holds arrays on it; the mapping goes when they do

    def close(self) -> None:
        """Destroys every slot; memory still viewed by a caller's arrays goes when they do."""
        self._returned.clear()
        for slot in list(self._slots.values()):
            self._destroy(slot)
        self._free.clear()
        self.retired.clear()

"""The messages between the consumer and its worker processes, one small frozen dataclass each.

Each worker has one duplex pipe (a socketpair). Over it, in order:

consumer -> worker
  `SetFunction`  the pickled function, sent once per worker (and again when it changes)
  `Run`          one item, the slot lent for its result, and slot bookkeeping
  `Stop`         end the worker loop
worker -> consumer, one reply per `Run`, in the order the items were sent
  `Done`         the result: a pickle whose large buffers lie in shared memory
  `Failed`       `fn` raised: the exception (if it pickles), a summary and the traceback

Descriptors do not travel inside messages (a pickle cannot carry one): a `Run` with `lend=True`
and a `Done` with `created > 0` are each followed, on the same socket, by one descriptor sent with
SCM_RIGHTS (`zephon.runners.transport.send_fd`). The receiver reads it right after the message.

Messages pickle as their class and a tuple of their fields (`__reduce__`): as small and as fast
as the positional tuples they replace, with names at both ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class _Message:
    """Pickles as `(class, fields)`: no per-message dict of field names on the pipe."""

    __slots__ = ()
    __match_args__: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), tuple(getattr(self, name) for name in self.__match_args__)


@dataclass(frozen=True, slots=True)
class SlotRef(_Message):
    """A shared-memory slot named on the wire: its consumer-chosen name and size in bytes."""

    name: str
    size: int


@dataclass(frozen=True, slots=True)
class SetFunction(_Message):
    """The function the worker applies to every item from now on, pickled once by the consumer.

    A worker that cannot unpickle it reports the error with every `Run` instead of dying, so the
    consumer sees the cause as an ordinary exception.
    """

    blob: bytes


@dataclass(frozen=True, slots=True)
class Stop(_Message):
    """Ends the worker loop (close() follows with SIGTERM, then SIGKILL, if the worker lingers)."""


@dataclass(frozen=True, slots=True)
class Run(_Message):
    """Compute `fn(item)`.

    slot: the slot lent for the result's buffers, or None (the worker then makes one).
    fresh: the name the worker gives a segment it creates (result larger than `slot`, or none).
    retired: slots the consumer destroyed since this worker's last `Run`: unmap them.
    lend: the worker has not mapped `slot` yet; its descriptor follows this message.
    """

    item: Any
    slot: SlotRef | None
    fresh: str
    retired: tuple[str, ...]
    lend: bool


@dataclass(frozen=True, slots=True)
class Done(_Message):
    """A result: `payload` is a protocol-5 pickle whose out-of-band buffers lie in slot `slot` at
    `spans` ((offset, nbytes) each). `created > 0`: the worker made that slot, of that size, and its
    descriptor follows; `created == 0`: it is the slot the consumer lent. No spans: no slot used."""

    payload: bytes
    spans: tuple[tuple[int, int], ...] = ()
    slot: str | None = None
    created: int = 0


@dataclass(frozen=True, slots=True)
class Failed(_Message):
    """`fn(item)` raised. `error`: the pickled exception, or None when it does not survive a pickle
    round trip; `summary`: 'Type: message'; `traceback`: the worker's formatted traceback."""

    error: bytes | None
    summary: str
    traceback: str


Request = SetFunction | Run | Stop
Reply = Done | Failed

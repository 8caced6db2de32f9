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

On the pipe a message is a plain tuple, `(KIND, *fields)` (`encode`, `decode`): the dataclasses give
names and types at both ends, while the wire stays as small and as cheap to pickle as the
positional tuples they replaced. (Pickling the dataclasses themselves works too, but costs an
import lookup of each class on both sides, ~20 us an item, which a pipe carrying thousands of
small items a second would feel.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class _Message:
    """Fields by position: on the wire (`to_wire`) and in a pickle (`__reduce__`)."""

    __slots__ = ()
    __match_args__: tuple[str, ...] = ()
    KIND: ClassVar[str] = ""

    def to_wire(self) -> tuple[Any, ...]:
        return (self.KIND, *(getattr(self, name) for name in self.__match_args__))

    @classmethod
    def from_wire(cls, wire: tuple[Any, ...]) -> Any:
        return cls(*wire[1:])

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

    KIND: ClassVar[str] = "fn"
    blob: bytes


@dataclass(frozen=True, slots=True)
class Stop(_Message):
    """Ends the worker loop (close() follows with SIGTERM, then SIGKILL, if the worker lingers)."""

    KIND: ClassVar[str] = "stop"


@dataclass(frozen=True, slots=True)
class Run(_Message):
    """Compute `fn(item)`.

    slot: the slot lent for the result's buffers, or None (the worker then makes one).
    fresh: the name the worker gives a segment it creates (result larger than `slot`, or none).
    retired: slots the consumer destroyed since this worker's last `Run`: unmap them.
    lend: the worker has not mapped `slot` yet; its descriptor follows this message.
    """

    KIND: ClassVar[str] = "task"
    item: Any
    slot: SlotRef | None
    fresh: str
    retired: tuple[str, ...]
    lend: bool

    def to_wire(self) -> tuple[Any, ...]:
        slot = None if self.slot is None else (self.slot.name, self.slot.size)
        return (self.KIND, self.item, slot, self.fresh, self.retired, self.lend)

    @classmethod
    def from_wire(cls, wire: tuple[Any, ...]) -> Run:
        _, item, slot, fresh, retired, lend = wire
        return cls(item, None if slot is None else SlotRef(*slot), fresh, retired, lend)


@dataclass(frozen=True, slots=True)
class Done(_Message):
    """A result: `payload` is a protocol-5 pickle whose out-of-band buffers lie in slot `slot` at
    `spans` ((offset, nbytes) each). `created > 0`: the worker made that slot, of that size, and its
    descriptor follows; `created == 0`: it is the slot the consumer lent. No spans: no slot used."""

    KIND: ClassVar[str] = "ok"
    payload: bytes
    spans: tuple[tuple[int, int], ...] = ()
    slot: str | None = None
    created: int = 0


@dataclass(frozen=True, slots=True)
class Failed(_Message):
    """`fn(item)` raised. `error`: the pickled exception, or None when it does not survive a pickle
    round trip; `summary`: 'Type: message'; `traceback`: the worker's formatted traceback."""

    KIND: ClassVar[str] = "err"
    error: bytes | None
    summary: str
    traceback: str


Request = SetFunction | Run | Stop
Reply = Done | Failed
Message = Request | Reply

_BY_KIND: dict[str, type[_Message]] = {c.KIND: c for c in (SetFunction, Stop, Run, Done, Failed)}


def encode(msg: Message) -> tuple[Any, ...]:
    """The tuple of builtins that travels for `msg`."""
    return msg.to_wire()


def decode(wire: tuple[Any, ...]) -> Message:
    """The message a wire tuple stands for (ValueError for an unknown kind)."""
    try:
        kind = _BY_KIND[wire[0]]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not a runner message: {wire!r:.200}") from None
    return kind.from_wire(wire)

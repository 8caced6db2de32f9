"""Grain's iterator-level steps as small stateful iterators: map, filter, batch, thread prefetch,
mix, interleave, window shuffle, flat map.

They run what follows the part of a pipeline that Zephon's plan executes (see `tail`): each is a
`grain.DatasetIterator` whose `get_state()` is a JSON document holding its parent's, so the
whole chain checkpoints like Grain's — and where the chain reads from a Zephon loader, the loader's
own state document is at the bottom. Every step holds no element between `next()` calls except
the ones whose buffer is their point (prefetch, window shuffle, interleave); those record the
parent's state with each buffered element, so `get_state()` is the consumer's position.
"""

from __future__ import annotations

import copy
import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np

from zephon.errors import WorkerError
from zephon.runners.closing import join_bounded

from .cipher import index_shuffle
from .order import mix_selection


def make_batch(values: Sequence[Any]) -> Any:
    """Grain's `make_batch`: a new leading axis on every leaf (`np.stack`; one value: expand);
    dicts come back with sorted keys, as Grain's tree functions return them."""
    if not values:
        raise ValueError("Cannot batch 0 values.")
    first = values[0]
    if isinstance(first, dict):
        return {k: make_batch([v[k] for v in values]) for k in sorted(first)}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(make_batch([v[i] for v in values]) for i in range(len(first))))
    if isinstance(first, (list, tuple)):
        return type(first)(make_batch([v[i] for v in values]) for i in range(len(first)))
    if len(values) == 1:
        return np.expand_dims(first, axis=0)
    return np.stack(values)


class Step(grain.DatasetIterator):
    """One Grain iterator step over a parent iterator (Grain's DatasetIterator API)."""

    def __init__(self, parent: Any) -> None:
        super().__init__()
        self.parent = parent

    def get_state(self) -> dict[str, Any]:
        return {"parent": self.parent.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.parent.set_state(state["parent"])

    def close(self) -> None:
        close = getattr(self.parent, "close", None)
        if close is not None:
            close()


class MapStep(Step):
    def __init__(self, parent: Any, fn: Callable[[Any], Any]) -> None:
        super().__init__(parent)
        self.fn = fn

    def __next__(self) -> Any:
        return self.fn(next(self.parent))


class FilterStep(Step):
    def __init__(self, parent: Any, fn: Callable[[Any], bool]) -> None:
        super().__init__(parent)
        self.fn = fn

    def __next__(self) -> Any:
        while True:
            e = next(self.parent)
            if self.fn(e):
                return e


class BatchStep(Step):
    """Grain's `IterDataset.batch`: a partial last batch unless `drop_remainder`."""

    def __init__(self, parent: Any, batch_size: int, drop_remainder: bool,
                 batch_fn: Callable[[Sequence[Any]], Any] | None) -> None:
        super().__init__(parent)
        self.size, self.drop, self.fn = batch_size, drop_remainder, batch_fn or make_batch

    def __next__(self) -> Any:
        values = list(itertools.islice(self.parent, self.size))
        if not values or (self.drop and len(values) < self.size):
            raise StopIteration
        return self.fn(values)


class FlatMapStep(Step):
    """Grain's `FlatMapIterDataset`: each element fans out to `transform.flat_map(e)`'s items."""

    def __init__(self, parent: Any, fn: Callable[[Any], Any]) -> None:
        super().__init__(parent)
        self.fn = fn
        self._items: list[Any] = []
        self._taken = 0
        self._before: Any = None

    def __next__(self) -> Any:
        while self._taken >= len(self._items):
            self._before = self.parent.get_state()
            self._items, self._taken = list(self.fn(next(self.parent))), 0
        self._taken += 1
        return self._items[self._taken - 1]

    def get_state(self) -> dict[str, Any]:
        if self._taken < len(self._items):
            return {"parent": self._before, "taken": self._taken}
        return {"parent": self.parent.get_state(), "taken": 0}

    def set_state(self, state: dict[str, Any]) -> None:
        self.parent.set_state(state["parent"])
        self._items, self._taken = [], 0
        if state.get("taken"):
            self._before = state["parent"]
            self._items, self._taken = list(self.fn(next(self.parent))), int(state["taken"])


_END = object()


class PrefetchStep(Step):
    """Grain's `ThreadPrefetchIterDataset`: a thread reads up to `size` elements ahead; each
    buffered element carries the parent's state after it, so `get_state()` is the consumer's."""

    def __init__(self, parent: Any, size: int) -> None:
        super().__init__(parent)
        self.size = max(int(size), 0)
        self._state = parent.get_state()
        self._q: queue.Queue[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._abandoned = False

    @staticmethod
    def _run(parent: Any, q: queue.Queue[Any], stop: threading.Event) -> None:
        # no reference to the step: an abandoned step is collected and `__del__` stops this
        try:
            while not stop.is_set():
                e = next(parent)
                item = (e, copy.deepcopy(parent.get_state()))
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:
            q.put((_END, exc))

    def __next__(self) -> Any:
        if self.size == 0:
            e = next(self.parent)
            self._state = self.parent.get_state()
            return e
        if self._q is None:
            self._q, self._stop = queue.Queue(self.size), threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self.parent, self._q, self._stop),
                                            daemon=True)
            self._thread.start()
        e, state = self._q.get()
        if e is _END:
            self._q.put((_END, state))  # stays exhausted / failed
            raise state
        self._state = state
        return e

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            q = self._q
            while q is not None:  # wakes a producer blocked on the full queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            # bounded: a parent stuck in a read is abandoned (daemon) with a warning
            if not join_bounded([self._thread], "a Grain-compatible ThreadPrefetchIterDataset iterator"):
                self._abandoned = True  # the thread still runs the parent: never touch it again
        self._q, self._thread = None, None

    def get_state(self) -> dict[str, Any]:
        return {"parent": copy.deepcopy(self._state)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._halt()
        if self._abandoned:
            raise WorkerError("this iterator's prefetch thread did not stop (blocked in a read) and "
                              "still holds its parent; build a new iterator and restore the state there.")
        self.parent.set_state(state["parent"])
        self._state = state["parent"]

    def close(self) -> None:
        self._halt()
        if not self._abandoned:  # an abandoned thread is inside the parent: leave it to it
            super().close()

    def __del__(self) -> None:
        self._stop.set()


class MixStep(grain.DatasetIterator):
    """Grain's `IterDataset.mix`: element k comes from the parent Grain's proportional
    selection names; the mix stops at the first exhausted parent (as Grain's)."""

    def __init__(self, parents: Sequence[Any], proportions: Sequence[int]) -> None:
        super().__init__()
        self.parents, self.proportions = list(parents), tuple(proportions)
        self.index, self.stop = 0, False

    def __next__(self) -> Any:
        if self.stop:
            raise StopIteration
        which, _ = mix_selection(np.array([self.index]), self.proportions)
        self.index += 1
        try:
            return next(self.parents[int(which[0])])
        except BaseException:
            self.stop = True
            raise

    def get_state(self) -> dict[str, Any]:
        return {"parents": [p.get_state() for p in self.parents], "index": self.index,
                "stop": self.stop}

    def set_state(self, state: dict[str, Any]) -> None:
        for p, s in zip(self.parents, state["parents"]):
            p.set_state(s)
        self.index, self.stop = int(state["index"]), bool(state["stop"])


class InterleaveStep(grain.DatasetIterator):
    """Grain's `InterleaveIterDataset` (its order, sequentially): `cycle_length` slots; a slot's
    dataset is opened when its turn comes, and an exhausted one frees the slot for the next."""

    def __init__(self, datasets: Sequence[Any], cycle_length: int) -> None:
        super().__init__()
        self.datasets, self.cycle = list(datasets), max(1, int(cycle_length))
        self.slots: list[Any] = [None] * self.cycle
        self.slot_ids: list[int | None] = [None] * self.cycle
        self.next_ds, self.pos = 0, 0

    def __next__(self) -> Any:
        while True:
            it = self.slots[self.pos]
            if it is not None:
                try:
                    e = next(it)
                    self.pos = (self.pos + 1) % self.cycle
                    return e
                except StopIteration:
                    self.slots[self.pos] = self.slot_ids[self.pos] = None
                    self.pos = (self.pos + 1) % self.cycle
                    continue
            if self.next_ds < len(self.datasets):
                self.slots[self.pos] = iter(self.datasets[self.next_ds])
                self.slot_ids[self.pos] = self.next_ds
                self.next_ds += 1
            elif not any(s is not None for s in self.slots):
                raise StopIteration
            else:
                self.pos = (self.pos + 1) % self.cycle

    def get_state(self) -> dict[str, Any]:
        return {"next_ds": self.next_ds, "pos": self.pos, "slot_ids": list(self.slot_ids),
                "slots": [None if s is None else s.get_state() for s in self.slots]}

    def set_state(self, state: dict[str, Any]) -> None:
        self.next_ds, self.pos = int(state["next_ds"]), int(state["pos"])
        self.slot_ids = list(state["slot_ids"])
        self.slots = []
        for i, s in zip(self.slot_ids, state["slots"]):
            it = None
            if i is not None:
                it = iter(self.datasets[i])
                it.set_state(s)
            self.slots.append(it)


class WindowShuffleStep(Step):
    """Grain's `WindowShuffleIterDataset`: windows of `window_size` consecutive elements, each
    permuted by Grain's `index_shuffle` (seed + window index) and emitted last position first."""

    def __init__(self, parent: Any, window_size: int, seed: int) -> None:
        super().__init__(parent)
        self.window, self.seed = int(window_size), int(seed)
        self._buf: list[Any] = []
        self._windows, self._pos = 0, 0
        self._start = parent.get_state()
        self._exhausted = False

    def _fill(self) -> None:
        values = []
        for e in self.parent:
            values.append(e)
            if len(values) == self.window:
                break
        else:
            self._exhausted = True
        if values:
            order = index_shuffle(np.arange(len(values)), len(values) - 1,
                                  (self.seed + self._windows) % 2 ** 32)
            values = [values[int(i)] for i in order]
        self._buf = values

    def __next__(self) -> Any:
        if not self._buf:
            if self._exhausted:
                raise StopIteration
            self._start = self.parent.get_state()
            self._fill()
            self._pos = 0
        if not self._buf:
            raise StopIteration
        self._pos += 1
        e = self._buf.pop()
        if not self._buf:
            self._windows += 1
        return e

    def get_state(self) -> dict[str, Any]:
        return {"parent": copy.deepcopy(self._start), "window_index": self._windows,
                "pos_in_window": self._pos}

    def set_state(self, state: dict[str, Any]) -> None:
        self._start = copy.deepcopy(state["parent"])
        self.parent.set_state(self._start)
        self._windows, self._pos = int(state["window_index"]), int(state["pos_in_window"])
        self._exhausted = False
        self._fill()
        for _ in range(min(self._pos, len(self._buf))):
            self._buf.pop()


def iterate(it: Any) -> Iterator[Any]:
    """`for e in it` over a step (a step is its own iterator)."""
    return iter(it)

"""Zephon loaders behind Grain's iterator API.

`Iterator` is a `grain.DatasetIterator` over a Zephon `Loader`: batches come out in Grain's
structure (`unflatten_columns`), `get_state`/`set_state` are Zephon's one JSON state document
(plus `elements_taken` inside a step when iterating unbatched), and `merge_states` joins every
rank's state into one that restores at another data-parallel degree. `CollatingLoader` wraps a
`Loader` so that its batches are always named columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import grain

from zephon.errors import StateError
from zephon.exec.loader import Loader, LocalBatch
from zephon.pipeline import How, Pipeline, Where
from zephon.telemetry import Stats, Telemetry

from .records import RECORD, RNG, collate, elements, grain_strings, unflatten_columns


def sorted_keys(tree: Any) -> Any:
    """Grain's batches hold dicts with sorted keys (its tree functions sort them)."""
    if isinstance(tree, dict):
        return {k: sorted_keys(tree[k]) for k in sorted(tree)}
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(sorted_keys(v) for v in tree)
    return tree


def _collated(batch: LocalBatch) -> LocalBatch:
    return replace(batch, data=collate(batch.data)) if RECORD in batch.data or RNG in batch.data else batch


class CollatingLoader:
    """A `zephon.Loader` whose batches are always named columns, never Grain record objects.

    A thin layer over one `Loader` (`self.loader`): it builds it from the same arguments
    (`CollatingLoader(pipeline, where=, how=, start_step=...)`), collates the Grain records
    left in a batch (a chain with a filter is collated here, once the step's rows are assembled:
    see `transforms.with_collate`), and hands everything else — `state()`, `restore()`,
    `position()`, `step`, `plan`, `stats()`, ... — to the loader. A `zephon.Pipeline`'s
    `loader_cls` for Grain-shaped pipelines.
    """

    def __init__(self, pipeline: Pipeline, where: Where | None = None, how: How | None = None,
                 **options: Any) -> None:
        #: the loader this one collates the batches of
        self.loader = Loader(pipeline, where, how, **options)

    def __iter__(self) -> CollatingLoader:
        return self

    def __next__(self) -> LocalBatch:
        return _collated(next(self.loader))

    def batch(self, step: int) -> LocalBatch:
        """Random access to global batch `step`, collated (see `Loader.batch`)."""
        return _collated(self.loader.batch(step))

    def strided(self, start: int, stride: int) -> Iterable[LocalBatch]:
        """Batches start, start+stride, ..., collated (see `Loader.strided`)."""
        return (_collated(b) for b in self.loader.strided(start, stride))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # everything else is the loader's
        if name == "loader":  # not built (an __init__ that raised): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> CollatingLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Iterator(grain.DatasetIterator):
    """Iterates a Zephon loader with Grain's iterator API: `get_state()` / `set_state()`.

    It is a `grain.DatasetIterator`, so Grain's Orbax `CheckpointHandler`
    (`grain.checkpoint.CheckpointSave/CheckpointRestore`) and Orbax's StatefulCheckpointable API
    save and restore it like any Grain iterator. The state is Zephon's one JSON state document
    (plan fingerprint, step, lane cursors) that every emitter reads and writes; unbatched
    iteration adds `elements_taken`, the offset inside a step.

    Over a finite plan, `set_epoch(e)` goes to the start of pass `e` — the order `repeat()` gives
    it — and the state records the epoch. `iter()` of the iterator is the iterator itself, as
    Grain's are (Grain's own steps call it on every batch), so an epoch loop calls `set_epoch`.
    """

    def __init__(self, loader: Loader | CollatingLoader, *, batched: bool = True) -> None:
        super().__init__()
        self.loader = loader
        # telemetry: this iterator's waits and its conversion time, plus the loader's stages
        self._tel = Telemetry(total=loader.telemetry.total) if loader.telemetry is not None else None
        if self._tel is not None:
            self._tel.include(loader.telemetry)  # type: ignore[arg-type]
        self.batched = batched
        self._rows: list[Any] = []
        self._taken = 0
        self._before: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Goes to the start of pass `epoch` over the finite plan."""
        self.loader.set_epoch(epoch)
        self.loader.settle_end()
        self._rows, self._taken = [], 0

    @staticmethod
    def emit(batch: LocalBatch, *, batched: bool) -> Any:
        if batched:
            return sorted_keys(unflatten_columns({k: grain_strings(v) for k, v in batch.data.items()}))
        return elements(batch.data)

    def __next__(self) -> Any:
        self._assert_not_closed()
        if self.batched:
            if self._tel is None:
                return self.emit(next(self.loader), batched=True)
            return self._tel.step(self._next_timed)
        while self._taken >= len(self._rows):
            self._before = self.loader.position()
            self._rows = self.emit(next(self.loader), batched=False)
            self._taken = 0
        self._taken += 1
        return self._rows[self._taken - 1]

    def _next_timed(self) -> Any:
        assert self._tel is not None
        batch = next(self.loader)
        return self._tel.timed("emit", self.emit, batch, batched=True)

    def stats(self) -> Stats:
        """Telemetry so far (see `zephon.telemetry`): batched iteration times this iterator's
        `next()`; unbatched iteration reports the loader's, per step."""
        if self._tel is None or not self.batched:
            return self.loader.stats()
        return self._tel.stats()

    @property
    def step(self) -> int:
        """The next global batch (step) of the underlying loader."""
        return self.loader.step

    def get_state(self) -> dict[str, Any]:
        """Zephon's state document (the one `Loader.state()`, `state_dict()` and
        `JaxLoader.state()` return; any of them restores it). Unbatched iteration stopped inside
        a step adds `"elements_taken"`: the step's elements already returned."""
        if not self.batched and self._taken < len(self._rows):
            assert self._before is not None  # set with every step's rows (`__next__`, `set_state`)
            return {**self.loader.state_from(self._before), "elements_taken": self._taken}
        return self.loader.state()

    def set_state(self, state: dict[str, Any], *, allow_batch_change: bool = False) -> None:
        """Continues from a state document of any Zephon emitter (or this iterator's);
        `allow_batch_change=True` accepts one saved under another global batch size."""
        if isinstance(state, Mapping) and "loader" in state and "zephon_state" not in state:
            state = {**state["loader"], "elements_taken": state.get("skip", 0)}  # before 0.2
        if not isinstance(state, Mapping):
            raise StateError(f"set_state needs the state document get_state() returned (a dict), "
                             f"got {type(state).__name__}")
        skip = state.get("elements_taken", 0)
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise StateError(f"the state's 'elements_taken' is {skip!r}; expected a non-negative "
                             "integer (elements of the step already returned). The state was edited.")
        self.loader.restore(state, allow_batch_change=allow_batch_change)
        self._rows, self._taken = [], 0
        if skip:
            if self.batched:
                raise StateError("this state stopped inside a step (elements_taken="
                                 f"{skip}) of an unbatched iterator; a batched one resumes at step "
                                 "boundaries only. Restore it with an unbatched iterator.")
            self._before = self.loader.position()
            self._rows = self.emit(next(self.loader), batched=False)
            if skip > len(self._rows):
                raise StateError(f"the state's 'elements_taken' is {skip}, but step "
                                 f"{self._before['step']} has {len(self._rows)} elements here; "
                                 "the state was edited or belongs to another pipeline.")
            self._taken = skip

    def close(self) -> None:
        self.loader.close()
        super().close()

    def __str__(self) -> str:
        return f"zephon.compat.grain.Iterator(step={self.loader.step})"


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One iterator state from every rank's `get_state()` taken at the same step (batched
    iteration), restorable by `set_state` at any data-parallel degree of the same pipeline —
    how a packed or token-mixed pipeline (whose lanes each carry their own position) changes D."""
    from zephon.exec.loader import merge_states as merge_loader_states

    if not states:
        raise StateError("merge_states needs at least one iterator state")
    docs = []
    for s in states:
        if isinstance(s, Mapping) and "loader" in s and "zephon_state" not in s:  # before 0.2
            s = {**s["loader"], "elements_taken": s.get("skip", 0)}
        if not isinstance(s, Mapping) or "zephon_state" not in s:
            raise StateError("not a Zephon state document; pass what get_state() returned.")
        if s.get("elements_taken", 0):
            raise StateError("cannot merge states taken inside a step (unbatched iteration, "
                             "elements_taken > 0); take them at a step boundary.")
        docs.append({k: v for k, v in s.items() if k != "elements_taken"})
    return merge_loader_states(docs)

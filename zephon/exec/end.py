"""The end of a finite plan: the step every data-parallel rank stops at, known before it comes.

With one-to-one pipelines the end follows from the algebra (`Batch.num_steps`). A pipeline that
changes the number of records (filter, tokenize + pack, a mix by tokens) makes it depend on the
data, and a rank runs only its own lanes — if each stopped when its own lanes ran out, ranks
would disagree on the last step (a hang in the first collective of data-parallel training). So a
rank *counts*: it runs its lanes' pipeline to their end, keeping only how many steps they fill,
and the ranks exchange two integers with one all-gather through the runtime already in use
(`torch.distributed`, `jax.distributed`; any `AllGather` function). With `remainder="pad"` the
plan ends at the first step where no lane has an output left (the maximum over ranks); with
"drop" at the first step some lane cannot fill (the minimum). Without an all-gather a process
counts every lane of the plan itself: the same answer, at the cost of the whole data.

Cost: one extra pass of the rank's lanes through the pipeline (reads, tokenizing, packing) per
epoch of a finite plan, before its first step — for an evaluation set, one more evaluation
pass without the model; and one all-gather of two integers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.lanes import LaneEngine
from zephon.exec.padding import Schema, blank_rows, schema_of
from zephon.exec.pipeline import LanePipeline
from zephon.exec.state import LaneState
from zephon.exec.steps import StepTask
from zephon.exec.windows import take_rows
from zephon.plan import Batch, Mix, Refs
from zephon.sources.base import Columns, RecordSource

if TYPE_CHECKING:  # annotation only: importing zephon.runners here would load it with the core
    from zephon.runners.base import Runner

#: `all_gather([a, b, ...])` -> every rank's list, in rank order (like `dist.all_gather_object`).
AllGather = Callable[[list[int]], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class LocalEnd:
    """What counting some lanes from `step` found: the first step none of them has a valid row
    for (`pad`), the first step one of them is short in (`drop`), and a row's schema."""

    pad: int
    drop: int
    schema: Schema | None


def count_end(engine: Any, step: int, pad: bool) -> LocalEnd:
    """Runs `engine` (a `LaneEngine` at `step`) to its lanes' end, counting steps; closes it.
    Dropping, it stops at the first short step (nothing after it is emitted)."""
    pad_end = drop_end = step
    schema: Schema | None = None
    full = True
    try:
        while True:
            try:
                cols, _, valid = engine.next()
            except StopIteration:
                break
            if schema is None:
                schema = schema_of(take_rows(cols, valid.nonzero()[0]))
            pad_end += 1
            if full and valid.all():
                drop_end += 1
            else:
                full = False
                if not pad:
                    break
    finally:
        engine.close()
    return LocalEnd(pad_end, drop_end, schema)


def agree(local: LocalEnd, all_gather: AllGather | None, pad: bool) -> int:
    """The plan's end from every rank's `LocalEnd` (just this one without an all-gather)."""
    if all_gather is None:
        return local.pad if pad else local.drop
    got = all_gather([local.pad, local.drop])
    try:
        ends = [(int(g[0]), int(g[1])) for g in got]
    except (TypeError, ValueError, IndexError):
        raise PlanError(f"all_gather returned {got!r}; it must return every rank's list of two "
                        "integers, in rank order (like torch.distributed.all_gather_object).") from None
    if not ends:
        raise PlanError("all_gather returned nothing; it must return every rank's list, this one's included.")
    return max(e[0] for e in ends) if pad else min(e[1] for e in ends)


class FiniteEnd:
    """Mixed into `Loader`: the steps of a count-changing pipeline up to the plan's end, padding
    where lanes ran out; `end_step()`, `len()` and `set_epoch()`."""

    plan: Batch
    sources: Mapping[int, RecordSource]
    pipeline: LanePipeline
    owned: np.ndarray
    seed: int
    runner: Runner | None
    read_ahead: int
    random_access: bool
    branches: int
    all_gather: AllGather | None
    epoch: int
    _ends: dict[int, int | None]
    _schema: Schema | None
    _done: bool
    _exhausted: bool
    _engine: LaneEngine | None
    _lane_states: list[LaneState]
    _everyone: tuple[int, list[LaneState]] | None
    _step: int
    _task: StepTask

    @property
    def num_steps(self) -> int | None:
        raise NotImplementedError  # the loader's

    def _start_states(self, lanes: np.ndarray | None = None) -> list[LaneState]:
        raise NotImplementedError  # the loader's

    def _stop_pending(self) -> None:
        raise NotImplementedError  # the loader's

    def _engine_step(self, sink: Any = None) -> tuple[Columns, Any, np.ndarray]:
        """The next step of a count-changing pipeline: the lanes' rows, padded where a lane ran
        out, or only padding once all owned lanes ran out and other ranks' lanes have not."""
        end = self.end_step() if self._agrees() else self._ends.get(self.epoch)
        if self._done or (end is not None and self._step >= end):
            raise StopIteration
        if self._exhausted:
            return self._blank_step()
        if self._engine is None:
            self._engine = LaneEngine(self.plan, self.sources, self.pipeline, self.owned, self.seed, self.runner,
                                      self.read_ahead, self._lane_states, self._step, self.epoch)
            self._engine.sink = sink
        mark = self._engine.mark() if end is None and not self.plan.pad else None
        try:
            cols, prov, valid = self._engine.next()
        except StopIteration:
            self._stop_pending()
            self._exhausted = True
            if end is None:  # every lane of the plan ran out here: the plan ends
                self._done = True
                raise
            return self._blank_step()
        except BaseException:
            self._stop_pending()  # state stays after the last yielded batch
            raise
        if not self.plan.pad and not valid.all():
            # dropping, the first step a lane cannot fill is past the end: back to before it
            self._stop_pending()
            if mark is not None:
                self._lane_states = LaneEngine.states_at(mark)
            self._done = True
            raise StopIteration
        if self._schema is None:
            self._schema = schema_of(take_rows(cols, valid.nonzero()[0]))
        return cols, prov, valid

    def _blank_step(self) -> tuple[Columns, Any, np.ndarray]:
        """A step of padding only (this rank's lanes ran out; another rank's have not)."""
        rows = len(self.owned) * self.plan.per_lane_at(self._step)
        schema = self._schema or self._probe_schema()
        prov: Any = ([[] for _ in range(rows)] if self.pipeline.acc is not None
                     else Refs(np.full(rows, -1, np.int64), np.full(rows, -1, np.int64),
                               np.full(rows, -1, np.int64)))
        return blank_rows(schema, rows), prov, np.zeros(rows, bool)

    def _probe_schema(self) -> Schema:
        """What a row looks like, from the first lane of the plan that has one."""
        for lane in range(self.plan.lanes.count):
            owned = np.array([lane], np.int64)
            engine = LaneEngine(self.plan, self.sources, self.pipeline, owned, self.seed, None,
                                self.plan.per_lane_at(0), self._start_states(owned), 0, self.epoch)
            try:
                cols, _, valid = engine.next()
            except StopIteration:
                continue
            finally:
                engine.close()
            schema = schema_of(take_rows(cols, valid.nonzero()[0]))
            if schema is not None:
                self._schema = schema
                return schema
        raise PlanError("no lane of this finite plan has a single output row, so there is nothing "
                        "to pad with; check the filter (it rejects every record).")

    # --- the end of a finite plan --------------------------------------------------------------
    @property
    def finite(self) -> bool:
        """Whether the plan ends (and so has epochs and a length)."""
        if self.random_access:
            return self.num_steps is not None
        limits = [self.plan.lanes.lane_limits(self.owned, b, self.plan.pad) for b in range(self.branches)]
        mix = self.plan.lanes.child
        if self.branches > 1 and isinstance(mix, Mix):
            used = [lim for lim, w in zip(limits, mix.normalized) if w > 0]
            return all(x is not None for x in used) if mix.stop == "all" else any(x is not None for x in used)
        return limits[0] is not None

    def _agrees(self) -> bool:
        """Whether this loader must learn the end from other lanes than its own before it comes."""
        return (not self.random_access and len(self.owned) < self.plan.lanes.count
                and self.epoch not in self._ends and self.finite)

    def settle_end(self) -> None:
        """Learns the plan's end now if this loader must hear it from other ranks (a finite
        count-changing plan at world > 1): the emitters call it on every rank, from the thread
        that runs collectives, when an epoch starts or a state is restored. No-op otherwise."""
        if self._agrees():
            self.end_step()

    def end_if_known(self) -> int | None:
        """The plan's end in this epoch if known without counting (else None)."""
        return self.num_steps if self.random_access else self._ends.get(self.epoch)

    def end_step(self) -> int | None:
        """The step this finite plan ends at in this epoch (its number of global batches), the
        same on every rank; None if it repeats forever. For a pipeline that changes the number
        of records the first call counts (see `zephon.exec.end`): every rank must call it (the
        emitters do, when they start an epoch)."""
        if self.random_access:
            return self.num_steps
        if self.epoch in self._ends:
            return self._ends[self.epoch]
        if not self.finite:
            self._ends[self.epoch] = None
            return None
        everything = len(self.owned) == self.plan.lanes.count
        if self.all_gather is not None or everything:  # this loader's lanes from where they are
            lanes = self.owned
            states = self._engine.states if self._engine is not None else self._lane_states
            step = self._step
        else:  # every lane of the plan: from a merged state restored here, else from the start
            lanes = np.arange(self.plan.lanes.count, dtype=np.int64)
            step, states = self._everyone or (0, self._start_states(lanes))
        engine = LaneEngine(self.plan, self.sources, self.pipeline, lanes, self.seed, None, self.read_ahead,
                            states, step, self.epoch)
        local = count_end(engine, step, self.plan.pad)
        self._schema = self._schema or local.schema
        end = agree(local, None if everything else self.all_gather, self.plan.pad)  # all lanes: no one to ask
        self._ends[self.epoch] = end
        return end

    def __len__(self) -> int:
        """Global batches left in this epoch of a finite plan (TypeError if it repeats forever)."""
        end = self.end_step()
        if end is None:
            raise TypeError("this Zephon loader has no length: its plan repeats forever "
                            "(build it without .repeat() or with .repeat(count)).")
        return max(0, end - self._step)

    def set_epoch(self, epoch: int) -> None:
        """Goes to step 0 of pass `epoch` over a finite plan (the order `repeat()` gives it)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise PlanError(f"epoch must be a non-negative integer, got {epoch!r}")
        if not self.finite:
            raise PlanError("set_epoch() needs a finite plan; this one repeats forever, and its epochs "
                            "are inside it (Repeat re-shuffles each pass).")
        self._stop_pending()
        self.epoch = int(epoch)
        self._task = dataclasses.replace(self._task, epoch=self.epoch)
        self._step = 0
        self._done = self._exhausted = False
        self._everyone = None
        if not self.random_access:
            self._lane_states = self._start_states()


__all__ = ["AllGather", "FiniteEnd", "LocalEnd", "agree", "count_end"]

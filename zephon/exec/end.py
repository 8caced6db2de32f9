"""The end of a finite plan: the step every data-parallel rank stops at, known before it comes.

With one-to-one pipelines the end follows from the algebra (`Batching.num_steps`). A pipeline that
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

Dropping, the count goes on past the end to the lanes' last rows: what the end leaves unemitted
(`Unemitted`, summed over ranks with a second all-gather of four integers) is known before step
0, kept in `Loader.unemitted` and `stats().unemitted`, and logged as a warning when it is more
than one global batch — PyTorch's `drop_last` never drops more, and with packing or filters a
"drop" end can lose whole lanes' tails. That is why `remainder="auto"` (the default) pads these
plans.
"""

from __future__ import annotations

import dataclasses
import logging
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
from zephon.plan import Batching, Mix, Refs
from zephon.sources.base import Columns, RecordSource
from zephon.telemetry import TOKEN_FIELDS, count_tokens

if TYPE_CHECKING:  # annotation only: importing zephon.runners here would load it with the core
    from zephon.runners.base import Runner

#: `all_gather([a, b, ...])` -> every rank's list, in rank order (like `dist.all_gather_object`).
AllGather = Callable[[list[int]], Sequence[Sequence[int]]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalEnd:
    """What counting some lanes from `step` found: the first step none of them has a valid row
    for (`pad`), the first step one of them is short in (`drop`), a row's schema, and per step
    counted the valid rows and their tokens (what the plan's end leaves unemitted follows)."""

    pad: int
    drop: int
    schema: Schema | None
    rows: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()

    def after(self, step: int, end: int) -> tuple[int, int]:
        """Valid rows and tokens of these lanes at steps `end, end + 1, ...` (counted from `step`)."""
        k = max(0, end - step)
        return sum(self.rows[k:]), sum(self.tokens[k:])


@dataclass(frozen=True)
class Unemitted:
    """What ending a finite plan at the last step every lane fills (`remainder="drop"`) leaves
    unemitted in pass `epoch`, over every rank: valid rows (records, or packed rows) and their
    tokens (0 without a token field), of the `total_rows` / `total_tokens` the lanes held from
    the step counting began at. PyTorch's `drop_last` leaves less than one batch. Besides,
    dropping deals every lane as many inputs as the shortest: `undealt` inputs (fewer than one
    per lane, as `drop_last`'s partial batch) never enter a lane, and are not in the counts."""

    epoch: int
    rows: int
    tokens: int
    total_rows: int
    total_tokens: int
    batch_rows: int  # the global batch at the plan's end step
    undealt: int = 0

    @property
    def share(self) -> float:
        """The fraction left unemitted: of the tokens when rows hold tokens, else of the rows."""
        if self.total_tokens:
            return self.tokens / self.total_tokens
        return self.rows / self.total_rows if self.total_rows else 0.0

    @property
    def more_than_a_batch(self) -> bool:
        return self.rows > self.batch_rows

    def message(self) -> str:
        what = (f"{self.tokens:,} of {self.total_tokens:,} tokens ({self.rows:,} rows)" if self.total_tokens
                else f"{self.rows:,} of {self.total_rows:,} records")
        return (f"remainder='drop' ends this finite plan at the last step every lane fills, leaving "
                f"{what} unemitted in epoch {self.epoch} — {100 * self.share:.1f}%"
                f"{f' (and {self.undealt} inputs never dealt to a lane)' if self.undealt else ''}, more than one "
                f"global batch ({self.batch_rows} rows): its lanes run out at different steps (a "
                "filter, packing or a mix by tokens changes their lengths). Build the plan with "
                ".batch(..., remainder='pad') (or leave remainder unset: 'auto' pads such plans) to "
                "emit every record exactly once, rows past a lane's end marked by the field 'valid'.")


def valid_tokens(cols: Columns, valid: np.ndarray) -> int:
    """Tokens in the valid rows of `cols`: non-zero `segment_ids` of packed rows, else the
    elements of the token field (`zephon.telemetry.TOKEN_FIELDS`); 0 without one."""
    seg = cols.get("segment_ids")
    if isinstance(seg, np.ndarray) and seg.dtype != object and len(seg) == len(valid):
        return int(np.count_nonzero(seg[valid]))
    for name in TOKEN_FIELDS:
        v = cols.get(name)
        if isinstance(v, np.ndarray) and len(v) == len(valid):
            return count_tokens({name: v[valid]})
    return 0


def count_end(engine: Any, step: int, pad: bool) -> LocalEnd:
    """Runs `engine` (a `LaneEngine` at `step`) to its lanes' end, counting steps and each
    step's valid rows and tokens; closes it. Dropping too it runs to the end: what lies past
    the first short step is what the end leaves unemitted."""
    pad_end = drop_end = step
    schema: Schema | None = None
    full = True
    rows: list[int] = []
    tokens: list[int] = []
    try:
        while True:
            try:
                cols, _, valid = engine.next()
            except StopIteration:
                break
            if schema is None:
                schema = schema_of(take_rows(cols, valid.nonzero()[0]))
            pad_end += 1
            if not pad:  # what the end leaves (padding leaves nothing)
                rows.append(int(np.count_nonzero(valid)))
                tokens.append(valid_tokens(cols, valid))
            if full and valid.all():
                drop_end += 1
            else:
                full = False
    finally:
        engine.close()
    return LocalEnd(pad_end, drop_end, schema, tuple(rows), tuple(tokens))


def _ints(got: Any, n: int) -> list[tuple[int, ...]]:
    try:
        out = [tuple(int(x) for x in g[:n]) for g in got]
    except (TypeError, ValueError, IndexError):
        out = []
    if not out or any(len(o) != n for o in out):
        raise PlanError(f"all_gather returned {got!r}; it must return every rank's list of {n} "
                        "integers, this one's included, in rank order (like "
                        "torch.distributed.all_gather_object).")
    return out


def agree(local: LocalEnd, all_gather: AllGather | None, pad: bool) -> int:
    """The plan's end from every rank's `LocalEnd` (just this one without an all-gather)."""
    if all_gather is None:
        return local.pad if pad else local.drop
    ends = _ints(all_gather([local.pad, local.drop]), 2)
    return max(e[0] for e in ends) if pad else min(e[1] for e in ends)


def unemitted_at(local: LocalEnd, step: int, end: int, epoch: int, batch_rows: int,
                 all_gather: AllGather | None, undealt: int = 0) -> Unemitted:
    """What ending at `end` leaves unemitted, summed over ranks with a second all-gather (four
    integers) when one is given — every rank that counts calls it, so the collectives match."""
    rows, tokens = local.after(step, end)
    mine = [rows, tokens, sum(local.rows), sum(local.tokens)]
    every = [tuple(mine)] if all_gather is None else _ints(all_gather(mine), 4)
    r, t, tr, tt = (sum(v[i] for v in every) for i in range(4))
    return Unemitted(epoch, r, t, tr, tt, batch_rows, undealt)


class FiniteEnd:
    """Mixed into `Loader`: the steps of a count-changing pipeline up to the plan's end, padding
    where lanes ran out; `end_step()`, `len()` and `set_epoch()`."""

    plan: Batching
    sources: Mapping[int, RecordSource]
    stages: LanePipeline
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
    _tel: Any
    unemitted: Unemitted | None
    _unemitted_said: bool
    _seen: list[int]  # valid rows and tokens emitted since the lane engine started (lazy drop)

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
            self._engine = LaneEngine(self.plan, self.sources, self.stages, self.owned, self.seed, self.runner,
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
            if end is None:  # not counted ahead: what is left is counted now (the rest only)
                self._count_rest(cols, valid)
            self._stop_pending()
            if mark is not None:
                self._lane_states = LaneEngine.states_at(mark)
            self._done = True
            raise StopIteration
        if self._schema is None:
            self._schema = schema_of(take_rows(cols, valid.nonzero()[0]))
        if mark is not None:  # dropping, end not counted: what was emitted, for the share lost
            self._seen[0] += len(valid)
            self._seen[1] += valid_tokens(cols, valid)
        return cols, prov, valid

    def _count_rest(self, cols: Columns, valid: np.ndarray) -> None:
        """At the first step a lane cannot fill (dropping, the end not counted ahead: this loader
        owns every lane): the rows and tokens of it and every step the lanes still hold."""
        rows, tokens = int(np.count_nonzero(valid)), valid_tokens(cols, valid)
        assert self._engine is not None
        while True:
            try:
                cols, _, valid = self._engine.next()
            except StopIteration:
                break
            rows += int(np.count_nonzero(valid))
            tokens += valid_tokens(cols, valid)
        self._found_unemitted(Unemitted(self.epoch, rows, tokens, rows + self._seen[0], tokens + self._seen[1],
                                        self.plan.size_at(self._step), self._undealt()))

    def _undealt(self) -> int:
        """Inputs a dropping plan deals to no lane (the last `n % lanes` of each finite branch)."""
        every = np.arange(self.plan.lanes.count, dtype=np.int64)
        out = 0
        for b in range(self.branches):
            dealt = self.plan.lanes.lane_limits(every, b, pad=True)
            kept = self.plan.lanes.lane_limits(every, b, pad=False)
            if dealt is not None and kept is not None:
                out += max(0, int(dealt.sum()) - int(kept.sum()))
        return out

    def _found_unemitted(self, found: Unemitted) -> None:
        """Keeps what the end leaves unemitted (`unemitted`, `stats().unemitted`); says it once
        when it is more than one global batch (PyTorch's `drop_last` drops less)."""
        self.unemitted = found
        if self._tel is not None:
            self._tel.unemitted = found
        if found.more_than_a_batch and not self._unemitted_said:
            self._unemitted_said = True
            log.warning("%s", found.message())

    def _blank_step(self) -> tuple[Columns, Any, np.ndarray]:
        """A step of padding only (this rank's lanes ran out; another rank's have not)."""
        rows = len(self.owned) * self.plan.per_lane_at(self._step)
        schema = self._schema or self._probe_schema()
        prov: Any = ([[] for _ in range(rows)] if self.stages.acc is not None
                     else Refs(np.full(rows, -1, np.int64), np.full(rows, -1, np.int64),
                               np.full(rows, -1, np.int64)))
        return blank_rows(schema, rows), prov, np.zeros(rows, bool)

    def _probe_schema(self) -> Schema:
        """What a row looks like, from the first lane of the plan that has one."""
        for lane in range(self.plan.lanes.count):
            owned = np.array([lane], np.int64)
            engine = LaneEngine(self.plan, self.sources, self.stages, owned, self.seed, None,
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
        engine = LaneEngine(self.plan, self.sources, self.stages, lanes, self.seed, None, self.read_ahead,
                            states, step, self.epoch)
        local = count_end(engine, step, self.plan.pad)
        self._schema = self._schema or local.schema
        gather = None if everything else self.all_gather  # all lanes counted: no one to ask
        end = agree(local, gather, self.plan.pad)
        self._ends[self.epoch] = end
        if not self.plan.pad:  # what the end leaves: said before the first step
            self._found_unemitted(unemitted_at(local, step, end, self.epoch, self.plan.size_at(end), gather,
                                                self._undealt()))
        return end

    def __len__(self) -> int:
        """Global batches left in this epoch of a finite plan (TypeError if it repeats forever).

        With `remainder="drop"` and a pipeline that changes the number of records, the count
        also finds what the end leaves unemitted: `loader.unemitted` (and `stats().unemitted`),
        logged as a warning when it is more than one global batch. "pad" leaves nothing."""
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
        self._seen = [0, 0]
        if not self.random_access:
            self._lane_states = self._start_states()


__all__ = ["AllGather", "FiniteEnd", "LocalEnd", "Unemitted", "agree", "count_end", "unemitted_at", "valid_tokens"]

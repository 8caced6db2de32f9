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

Terms (docs/glossary.md): remainder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.lanes import LaneEngine, LaneRun
from zephon.exec.padding import Schema, blank_rows, schema_of
from zephon.exec.state import LaneState
from zephon.exec.windows import take_rows
from zephon.plan import Batching, Mix, Refs
from zephon.sources.base import Columns
from zephon.telemetry import TOKEN_FIELDS, count_tokens

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


def lanes_finite(plan: Batching, owned: np.ndarray, branches: int) -> bool:
    """Whether the lanes `owned` of a count-changing plan end (a mix: when its `stop` rule ends)."""
    limits = [plan.lanes.lane_limits(owned, b, plan.pad) for b in range(branches)]
    mix = plan.lanes.child
    if branches > 1 and isinstance(mix, Mix):
        used = [lim for lim, w in zip(limits, mix.normalized) if w > 0]
        return all(x is not None for x in used) if mix.stop == "all" else any(x is not None for x in used)
    return limits[0] is not None


class End:
    """The end of a finite count-changing plan for one loader's lanes: the step it comes at in
    each epoch (counted, and agreed with the other ranks), the padding once this loader's lanes
    ran out, and what a dropping end leaves unemitted (see the module doc).

    Args:
      lanes: what runs in the loader's lanes (`LaneRun`): the counting runs it again.
      all_gather: how ranks exchange their counts (None: this loader counts every lane).
      epoch, known: the end step of pass `epoch` if the caller knows it already (a DataLoader's
        workers are told it), else None.
      report: called with what the end leaves unemitted once it is known (telemetry).
    """

    def __init__(self, lanes: LaneRun, all_gather: AllGather | None, epoch: int, known: int | None,
                 report: Callable[[Unemitted], None] | None = None) -> None:
        self.lanes = lanes
        self.all_gather = all_gather
        self.report = report
        #: the end step of every epoch counted (or told) so far; None: that epoch never ends
        self.ends: dict[int, int | None] = {} if known is None else {epoch: int(known)}
        #: what a valid row looks like (padding rows copy it), once a row was seen
        self.schema: Schema | None = None
        #: the plan ended here (no more batches until set_epoch or a restore)
        self.done = False
        #: every owned lane ran out: the steps left to the end are padding
        self.exhausted = False
        #: every lane's states at a step, from a merged state restored here (for counting the end)
        self.everyone: tuple[int, list[LaneState]] | None = None
        #: valid rows and tokens emitted since the lane engine started (dropping, end not counted)
        self.seen = [0, 0]
        #: what the plan's end leaves unemitted in an epoch (`remainder="drop"`), once known
        self.unemitted: Unemitted | None = None
        self._said = False  # the warning about `unemitted` was logged

    @property
    def finite(self) -> bool:
        """Whether the plan ends for these lanes (and so has epochs and a length)."""
        return lanes_finite(self.lanes.plan, self.lanes.owned, self.lanes.branches)

    def restart(self) -> None:
        """The loader moved (a seek, a restore, a new epoch): nothing has ended or been seen."""
        self.done = self.exhausted = False
        self.everyone = None
        self.seen = [0, 0]

    def forget(self) -> None:
        """Forgets every end counted (the lanes went on under other batch sizes)."""
        self.ends.clear()

    def agrees(self, epoch: int) -> bool:
        """Whether this loader must learn the end of `epoch` from other lanes than its own
        before it comes."""
        plan = self.lanes.plan
        return len(self.lanes.owned) < plan.lanes.count and epoch not in self.ends and self.finite

    def count(self, step: int, epoch: int, states: list[LaneState]) -> int | None:
        """The step the plan ends at in `epoch`, counting the first time (`states`: the owned
        lanes' states at `step`, where this loader is). Every rank must call it."""
        if epoch in self.ends:
            return self.ends[epoch]
        if not self.finite:
            self.ends[epoch] = None
            return None
        run = self.lanes
        plan = run.plan
        everything = len(run.owned) == plan.lanes.count
        if self.all_gather is not None or everything:  # this loader's lanes from where they are
            lanes = run.owned
        else:  # every lane of the plan: from a merged state restored here, else from the start
            lanes = np.arange(plan.lanes.count, dtype=np.int64)
            step, states = self.everyone or (0, run.start_states(lanes))
        local = count_end(run.engine(lanes, states, step, epoch), step, plan.pad)
        self.schema = self.schema or local.schema
        gather = None if everything else self.all_gather  # all lanes counted: no one to ask
        end = agree(local, gather, plan.pad)
        self.ends[epoch] = end
        if not plan.pad:  # what the end leaves: said before the first step
            self.found(unemitted_at(local, step, end, epoch, plan.size_at(end), gather, self.undealt()))
        return end

    def seen_rows(self, cols: Columns, valid: np.ndarray) -> None:
        """Counts an emitted step's valid rows and tokens (dropping, the end not counted ahead)."""
        self.seen[0] += len(valid)
        self.seen[1] += valid_tokens(cols, valid)

    def count_rest(self, engine: LaneEngine, cols: Columns, valid: np.ndarray, step: int, epoch: int) -> None:
        """At the first step a lane cannot fill (dropping, the end not counted ahead: this loader
        owns every lane): the rows and tokens of it and every step the lanes still hold."""
        rows, tokens = int(np.count_nonzero(valid)), valid_tokens(cols, valid)
        while True:
            try:
                cols, _, valid = engine.next()
            except StopIteration:
                break
            rows += int(np.count_nonzero(valid))
            tokens += valid_tokens(cols, valid)
        self.found(Unemitted(epoch, rows, tokens, rows + self.seen[0], tokens + self.seen[1],
                             self.lanes.plan.size_at(step), self.undealt()))

    def undealt(self) -> int:
        """Inputs a dropping plan deals to no lane (the last `n % lanes` of each finite branch)."""
        plan = self.lanes.plan
        every = np.arange(plan.lanes.count, dtype=np.int64)
        out = 0
        for b in range(self.lanes.branches):
            dealt = plan.lanes.lane_limits(every, b, pad=True)
            kept = plan.lanes.lane_limits(every, b, pad=False)
            if dealt is not None and kept is not None:
                out += max(0, int(dealt.sum()) - int(kept.sum()))
        return out

    def found(self, found: Unemitted) -> None:
        """Keeps what the end leaves unemitted (`unemitted`, `stats().unemitted`); says it once
        when it is more than one global batch (PyTorch's `drop_last` drops less)."""
        self.unemitted = found
        if self.report is not None:
            self.report(found)
        if found.more_than_a_batch and not self._said:
            self._said = True
            log.warning("%s", found.message())

    def blank(self, step: int, epoch: int) -> tuple[Columns, Any, np.ndarray]:
        """A step of padding only (this rank's lanes ran out; another rank's have not)."""
        run = self.lanes
        rows = len(run.owned) * run.plan.per_lane_at(step)
        schema = self.schema or self._probe_schema(epoch)
        prov: Any = ([[] for _ in range(rows)] if run.stages.acc is not None
                     else Refs(np.full(rows, -1, np.int64), np.full(rows, -1, np.int64),
                               np.full(rows, -1, np.int64)))
        return blank_rows(schema, rows), prov, np.zeros(rows, bool)

    def _probe_schema(self, epoch: int) -> Schema:
        """What a row looks like, from the first lane of the plan that has one."""
        run = self.lanes
        for lane in range(run.plan.lanes.count):
            owned = np.array([lane], np.int64)
            engine = run.engine(owned, run.start_states(owned), 0, epoch, read_ahead=run.plan.per_lane_at(0))
            try:
                cols, _, valid = engine.next()
            except StopIteration:
                continue
            finally:
                engine.close()
            schema = schema_of(take_rows(cols, valid.nonzero()[0]))
            if schema is not None:
                self.schema = schema
                return schema
        raise PlanError("no lane of this finite plan has a single output row, so there is nothing "
                        "to pad with; check the filter (it rejects every record).")


__all__ = ["AllGather", "End", "LocalEnd", "Unemitted", "agree", "count_end", "lanes_finite", "unemitted_at",
           "valid_tokens"]

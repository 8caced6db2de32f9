"""The one-to-one path of the lane engine: every carry empty, every cursor `step × rows`.

When no operator changes the number of records, lane `l`'s position after step `k` is
`k × B/L` and its carry is empty, so any step can be computed directly: this is the random-access
special case of the lane engine (`zephon.exec.lanes`). A `StepTask` is a pure, picklable
function of a group of consecutive steps; runners map it over groups, and each step's rows are
zero-copy views of one bulk read.

Terms (docs/glossary.md): one-to-one, read-ahead, step.
"""

from __future__ import annotations

import itertools
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.padding import Schema, scatter, schema_of
from zephon.ops.base import Transform, run_transforms
from zephon.plan import Batching, Refs
from zephon.sources.base import Columns, RecordSource
from zephon.telemetry import column_bytes

if TYPE_CHECKING:  # annotation only: importing zephon.runners here would load it with the core
    from zephon.runners.base import Runner


def read_refs(sources: Mapping[int, RecordSource], refs: Refs) -> Columns:
    """Reads the records behind `refs` with one vectorised read per source, in `refs` order."""
    n = len(refs)
    ids = np.unique(refs.source)
    if len(ids) == 1:
        return sources[int(ids[0])].read(refs.record)
    out: Columns = {}
    for sid in ids:
        rows = np.flatnonzero(refs.source == sid)
        cols = sources[int(sid)].read(refs.record[rows])
        for k, v in cols.items():
            if k not in out:
                out[k] = np.empty((n,) + v.shape[1:], dtype=v.dtype)
            elif out[k].shape[1:] != v.shape[1:] or (out[k].dtype != v.dtype and out[k].dtype != object):
                raise PlanError(f"field {k!r} of source {int(sid)} has dtype {v.dtype} shape "
                                f"{v.shape[1:]} but another mixed source gives {out[k].dtype} "
                                f"{out[k].shape[1:]}; map the sources to one schema before mixing.")
            out[k][rows] = v
        missing = set(out) - set(cols)
        if missing:
            raise PlanError(f"source {int(sid)} lacks fields {sorted(missing)} that other mixed "
                            "sources have; map the sources to one schema before mixing.")
    return out


#: Rows one group read aims for. Per-call costs (resolving the plan's permutation, one bulk
#: `read`, one decode) are amortised over the group; ArrayRecord reads of 1k-16k shuffled records
#: run at 2-3x the per-record rate of 64-record reads. Bounded by `READ_AHEAD_BYTES`.
READ_AHEAD_ROWS = 16384
#: Upper bound on the bytes one group read materialises (large records get fewer steps per read).
READ_AHEAD_BYTES = 16 << 20


def steps_refs(plan: Batching, start: int, count: int, lanes: np.ndarray, stride: int = 1,
               epoch: int = 0) -> Refs:
    """The refs of steps start, start+stride, ... (`count` of them, rows owned by `lanes`) in
    pass `epoch` over the plan; with `remainder="pad"`, rows past a lane's end have source -1.

    Equal to concatenating `plan.refs(s, lanes)` over those steps, but resolved in one
    vectorised call, which is what makes small batches cheap.
    """
    return steps_rows(plan, start, count, lanes, stride, 0, epoch)[0]


def steps_rows(plan: Batching, start: int, count: int, lanes: np.ndarray, stride: int = 1, shift: int = 0,
               epoch: int = 0) -> tuple[Refs, np.ndarray]:
    """`steps_refs` and how many rows each step has (a batch-size schedule changes them);
    `shift` moves every lane position (a run resumed at another batch size)."""
    n = plan.num_steps if not shift else _steps_with_shift(plan, shift)
    if start < 0 or count < 1 or stride < 1:
        raise PlanError(f"need start >= 0, count >= 1 and stride >= 1, got start={start}, "
                        f"count={count}, stride={stride}")
    last = start + (count - 1) * stride
    if n is not None and last >= n:
        raise PlanError(f"step {last} runs past the end of the plan ({n} global batches)")
    steps = start + stride * np.arange(count, dtype=np.int64)
    lane, index, rows = plan.sizes.rows(steps, np.asarray(lanes, np.int64), shift)
    if plan.pad:
        limit = plan.lanes.lane_limits(lane, 0, pad=True)
        ok = index < limit if limit is not None else np.ones(len(index), bool)
        if not ok.all():
            refs = plan.lanes.resolve_lanes(lane[ok], index[ok], 0, epoch)
            full = []
            for v in (refs.source, refs.record, refs.epoch):
                c = np.full(len(index), -1, np.int64)
                c[ok] = v
                full.append(c)
            return Refs(full[0], full[1], full[2]), rows
    return plan.lanes.resolve_lanes(lane, index, 0, epoch), rows


def _steps_with_shift(plan: Batching, shift: int) -> int | None:
    return plan.steps_over(shift)


@dataclass(frozen=True)
class GroupResult:
    """The owned rows of consecutive steps from one read; `error` stops the group at a step.

    A failure in step k of a group (a transform raising, a corrupt record) must not lose steps
    before k: they are delivered, then `error` is raised where an inline loader would raise it.
    """

    start: int
    batches: list[tuple[Columns, Refs]]
    error: BaseException | None = None
    traceback: str = ""
    #: telemetry (`zephon.telemetry`): seconds reading, seconds in transforms, bytes read
    read_s: float = 0.0
    ops_s: float = 0.0
    nbytes: int = 0

    def raise_error(self) -> None:
        raise_captured(self.error, self.traceback)


def raise_captured(error: BaseException | None, tb: str) -> None:
    """Re-raises an error a step or window captured (nothing if None); one that crossed a
    process boundary lost its traceback, so the worker's is chained as `RemoteTraceback`."""
    if error is None:
        return
    if error.__traceback__ is None and tb:
        from zephon.runners import RemoteTraceback

        raise error from RemoteTraceback(tb)
    raise error


@dataclass(frozen=True)
class StepTask:
    """A picklable, pure function step -> owned rows, for one-to-one pipelines.

    Runners call it from threads or processes; it holds no mutable state. `run(start, count)`
    reads the records of `count` consecutive steps with one `read_refs` (one bulk read per source),
    and hands each step its rows as views of the group's arrays (no copy); transforms still run
    per step, so a batched transform sees exactly one step's rows, as it would inline.
    """

    plan: Batching
    sources: Mapping[int, RecordSource]
    transforms: tuple[Transform, ...]
    lanes: np.ndarray
    seed: int
    epoch: int = 0
    shift: int = 0  # lane positions relative to the plan's (resumed at another batch size)

    @property
    def num_steps(self) -> int | None:
        return self.plan.num_steps if not self.shift else _steps_with_shift(self.plan, self.shift)

    def __call__(self, step: int) -> tuple[Columns, Refs]:
        result = self.run(step, 1)
        result.raise_error()
        return result.batches[0]

    def run(self, start: int, count: int, stride: int = 1) -> GroupResult:
        t0 = time.perf_counter()
        try:
            refs, rows = steps_rows(self.plan, start, count, self.lanes, stride, self.shift, self.epoch)
            valid = refs.source >= 0
            if not valid.all():  # the padded end of a finite plan
                return self._padded(start, rows, refs, valid)
            cols = read_refs(self.sources, refs)
        except Exception:
            if count == 1:
                return _failed(start, [])
            return self._one_by_one(start, count, stride)  # error path: pin the failure on its step
        t1 = time.perf_counter()
        ends = np.cumsum(rows)
        out: list[tuple[Columns, Refs]] = []
        for k in range(count):
            cut = slice(int(ends[k] - rows[k]), int(ends[k]))
            part = {name: v[cut] for name, v in cols.items()}
            step_refs = refs.take(cut)
            if self.transforms:
                try:
                    part, _ = run_transforms(self.transforms, part, step_refs, self.seed)
                except Exception:
                    return _failed(start, out)
            out.append((part, step_refs))
        t2 = time.perf_counter()
        return GroupResult(start, out, read_s=t1 - t0, ops_s=t2 - t1, nbytes=column_bytes(cols))

    def _padded(self, start: int, rows: np.ndarray, refs: Refs, valid: np.ndarray) -> GroupResult:
        """Steps with padding rows: each step's valid rows read and transformed, then placed
        among zero rows shaped like a real row (padding rows keep their refs at -1)."""
        ends = np.cumsum(rows)
        out: list[tuple[Columns, Refs]] = []
        for k in range(len(rows)):
            cut = slice(int(ends[k] - rows[k]), int(ends[k]))
            step_refs, ok = refs.take(cut), valid[cut]
            try:
                real = step_refs.take(ok)
                part = read_refs(self.sources, real) if len(real) else {}
                if self.transforms and len(real):
                    part, _ = run_transforms(self.transforms, part, real, self.seed)
                out.append((scatter(part, ok, None if len(real) else self._schema()), step_refs))
            except Exception:
                return _failed(start, out)
        return GroupResult(start, out)

    def _schema(self) -> Schema | None:
        """What a row of this plan looks like: its first record, read and transformed."""
        first = self.plan.lanes.resolve_lanes(np.zeros(1, np.int64), np.zeros(1, np.int64), 0, self.epoch)
        cols = read_refs(self.sources, first)
        if self.transforms:
            cols, _ = run_transforms(self.transforms, cols, first, self.seed)
        return schema_of(cols)

    def _one_by_one(self, start: int, count: int, stride: int) -> GroupResult:
        out: list[tuple[Columns, Refs]] = []
        for step in range(start, start + count * stride, stride):
            single = self.run(step, 1)
            if single.error is not None:
                return GroupResult(start, out, single.error, single.traceback)
            out.extend(single.batches)
        return GroupResult(start, out)


def _failed(start: int, done: list[tuple[Columns, Refs]]) -> GroupResult:
    """The group so far plus the exception being handled (call from an except block)."""
    return GroupResult(start, done, sys.exc_info()[1], traceback.format_exc())


#: Telemetry's hook: a group (or window) result and the seconds the consumer waited for it.
Sink = Callable[[Any, float], None]


@dataclass(frozen=True)
class GroupTask:
    """`(start, count, stride) -> GroupResult`: what a runner maps over (picklable, pure)."""

    task: StepTask

    def __call__(self, item: tuple[int, int, int]) -> GroupResult:
        return self.task.run(*item)


def iterate_steps(task: StepTask, runner: Runner | None, start: int, read_ahead: int, stride: int = 1,
                  sink: Sink | None = None) -> Iterator[tuple[Columns, Refs]]:
    """Owned rows of steps start, start+stride, ...: the first inline, the rest in group reads.

    The first step is computed in the caller's thread, so it comes back as fast as one step can,
    and its size bounds the group reads (`READ_AHEAD_BYTES`) before any is issued. A module-level
    generator (not a method) so that a dropped loader is freed at once, closing its runner.
    `sink(result, seconds)` (telemetry) gets every group and how long the caller waited for it.
    """
    t0 = time.perf_counter()
    first = task.run(start, 1)
    if sink is not None:
        sink(first, time.perf_counter() - t0)
    yield from first.batches
    first.raise_error()
    plan = task.plan
    grow = max(b for _, b in plan.sizes.stretches()) / plan.size_at(start)  # a ramp's largest step
    rows = max(1, int(len(task.lanes) * plan.per_lane_at(start) * grow))
    group = max(1, read_ahead // rows)
    nbytes = sum(v.nbytes for v in first.batches[0][0].values() if v.dtype != object)
    if nbytes:
        group = max(1, min(group, int(READ_AHEAD_BYTES // (nbytes * grow))))
    n = task.num_steps
    nxt = start + stride
    starts = itertools.count(nxt, group * stride) if n is None else range(nxt, n, group * stride)
    items = ((s, group if n is None else min(group, -(-(n - s) // stride)), stride) for s in starts)
    gtask = GroupTask(task)
    results = map(gtask, items) if runner is None else iter(runner.imap(gtask, items))
    try:
        while True:
            t0 = time.perf_counter()
            result = next(results, None)
            if result is None:
                break
            if sink is not None:
                sink(result, time.perf_counter() - t0)
            yield from result.batches
            result.raise_error()
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()

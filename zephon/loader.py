"""Plan + sources + transforms -> the rows of global batches this process owns, with state.

The loader is lane-oriented. A data-parallel rank materialises only the rows of the lanes it
owns; each lane carries a `LaneState` (its input cursor, and room for an accumulator's carry), so
pipelines that change counts (filter, later packing) still produce per-lane streams that depend
only on the lane. For one-to-one pipelines lane state is derived from the step, so batches are
random access and restoring at any step is O(1); otherwise a restore loads the saved lane
states, O(lanes).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from zephon.errors import PlanError, StateError
from zephon.plan import Batch, Node, Refs, plan_diff
from zephon.sources.base import Columns, RecordSource
from zephon.transforms import Transform, run_transforms

log = logging.getLogger(__name__)
STATE_VERSION = 1


@dataclass(frozen=True)
class LaneState:
    """What a lane needs to continue: next input index, plus an accumulator's carry (JSON)."""

    cursor: int
    carry: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"cursor": int(self.cursor), "carry": self.carry}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "LaneState":
        cursor = obj.get("cursor")
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise StateError(f"lane state has an invalid cursor {cursor!r}")
        return LaneState(cursor, dict(obj.get("carry", {})))


@dataclass(frozen=True)
class LocalBatch:
    """The rows of global batch `step` that this process owns, in global row order."""

    step: int
    data: Columns
    lanes: np.ndarray
    rows_per_lane: int
    global_rows: int

    def lane_slice(self, k: int) -> slice:
        """Rows of the k-th owned lane within `data`."""
        return slice(k * self.rows_per_lane, (k + 1) * self.rows_per_lane)

    def global_shape(self, name: str) -> tuple[int, ...]:
        return (self.global_rows,) + tuple(self.data[name].shape[1:])

    @property
    def contiguous(self) -> bool:
        """Whether the owned rows form one contiguous block of the global batch."""
        return bool(np.all(np.diff(self.lanes) == 1))

    @property
    def row_offset(self) -> int:
        """First global row of this process's rows (contiguous ownership)."""
        return int(self.lanes[0]) * self.rows_per_lane if len(self.lanes) else 0


def as_source_map(sources: RecordSource | Sequence[RecordSource] | Mapping[int, RecordSource]
                  ) -> dict[int, RecordSource]:
    if isinstance(sources, Mapping):
        return {int(k): v for k, v in sources.items()}
    if isinstance(sources, (list, tuple)):
        return dict(enumerate(sources))
    return {0: sources}  # type: ignore[dict-item]


def _leaf_sources(node: Node) -> list[Any]:
    from zephon.plan import Source
    if isinstance(node, Source):
        return [node]
    kids = getattr(node, "children", None) or ((node.child,) if hasattr(node, "child") else ())
    return [s for c in kids for s in _leaf_sources(c)]


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


def steps_refs(plan: Batch, start: int, count: int, lanes: np.ndarray, stride: int = 1) -> Refs:
    """The refs of steps start, start+stride, ... (`count` of them, rows owned by `lanes`).

    Equal to concatenating `plan.refs(s, lanes)` over those steps, but resolved in one
    vectorised call, which is what makes small batches cheap.
    """
    n = plan.num_steps
    if start < 0 or count < 1 or stride < 1:
        raise PlanError(f"need start >= 0, count >= 1 and stride >= 1, got start={start}, "
                        f"count={count}, stride={stride}")
    last = start + (count - 1) * stride
    if n is not None and last >= n:
        raise PlanError(f"step {last} runs past the end of the plan ({n} global batches)")
    b = plan.per_lane
    lanes = np.asarray(lanes, np.int64)
    lane = np.tile(np.repeat(lanes, b), count)
    within = np.tile(np.arange(b, dtype=np.int64), len(lanes))
    steps = start + stride * np.arange(count, dtype=np.int64)
    index = (steps[:, None] * b + within).ravel()
    return plan.lanes.resolve(plan.lanes.stream_positions(lane, index))


@dataclass(frozen=True)
class GroupResult:
    """The owned rows of consecutive steps from one read; `error` stops the group at a step.

    A failure in step k of a group (a transform raising, a corrupt record) must not lose steps
    before k: they are delivered, then `error` is raised where an inline loader would raise it.
    """

    start: int
    batches: list[Columns]
    error: BaseException | None = None
    traceback: str = ""

    def raise_error(self) -> None:
        if self.error is None:
            return
        if self.error.__traceback__ is None and self.traceback:  # crossed a process boundary
            from zephon.runners import RemoteTraceback

            raise self.error from RemoteTraceback(self.traceback)
        raise self.error


@dataclass(frozen=True)
class StepTask:
    """A picklable, pure function step -> owned rows, for one-to-one pipelines.

    Runners call it from threads or processes; it holds no mutable state. `run(start, count)`
    reads the records of `count` consecutive steps with one `read_refs` (one bulk read per source),
    and hands each step its rows as views of the group's arrays (no copy); transforms still run
    per step, so a batched transform sees exactly one step's rows, as it would inline.
    """

    plan: Batch
    sources: Mapping[int, RecordSource]
    transforms: tuple[Transform, ...]
    lanes: np.ndarray
    seed: int

    def __call__(self, step: int) -> Columns:
        result = self.run(step, 1)
        result.raise_error()
        return result.batches[0]

    def run(self, start: int, count: int, stride: int = 1) -> GroupResult:
        try:
            refs = steps_refs(self.plan, start, count, self.lanes, stride)
            cols = read_refs(self.sources, refs)
        except Exception:
            if count == 1:
                return _failed(start, [])
            return self._one_by_one(start, count, stride)  # error path: pin the failure on its step
        rows = len(refs) // count
        out: list[Columns] = []
        for k in range(count):
            part = {name: v[k * rows:(k + 1) * rows] for name, v in cols.items()}
            if self.transforms:
                try:
                    part, _ = run_transforms(self.transforms, part, refs.take(slice(k * rows, (k + 1) * rows)),
                                             self.seed)
                except Exception:
                    return _failed(start, out)
            out.append(part)
        return GroupResult(start, out)

    def _one_by_one(self, start: int, count: int, stride: int) -> GroupResult:
        out: list[Columns] = []
        for step in range(start, start + count * stride, stride):
            single = self.run(step, 1)
            if single.error is not None:
                return GroupResult(start, out, single.error, single.traceback)
            out.extend(single.batches)
        return GroupResult(start, out)


def _failed(start: int, done: list[Columns]) -> GroupResult:
    """The group so far plus the exception being handled (call from an except block)."""
    return GroupResult(start, done, sys.exc_info()[1], traceback.format_exc())


@dataclass(frozen=True)
class GroupTask:
    """`(start, count, stride) -> GroupResult`: what a runner maps over (picklable, pure)."""

    task: StepTask

    def __call__(self, item: tuple[int, int, int]) -> GroupResult:
        return self.task.run(*item)


def _iterate(task: StepTask, runner: Any, start: int, read_ahead: int, stride: int = 1) -> Iterator[Columns]:
    """Owned rows of steps start, start+stride, ...: the first inline, the rest in group reads.

    The first step is computed in the caller's thread, so it comes back as fast as one step can,
    and its size bounds the group reads (`READ_AHEAD_BYTES`) before any is issued. A module-level
    generator (not a method) so that a dropped loader is freed at once, closing its runner.
    """
    first = task.run(start, 1)
    yield from first.batches
    first.raise_error()
    plan = task.plan
    rows = max(1, len(task.lanes) * plan.per_lane)
    group = max(1, read_ahead // rows)
    nbytes = sum(v.nbytes for v in first.batches[0].values() if v.dtype != object)
    if nbytes:
        group = max(1, min(group, READ_AHEAD_BYTES // nbytes))
    n = plan.num_steps
    nxt = start + stride
    starts = itertools.count(nxt, group * stride) if n is None else range(nxt, n, group * stride)
    items = ((s, group if n is None else min(group, -(-(n - s) // stride)), stride) for s in starts)
    gtask = GroupTask(task)
    results = map(gtask, items) if runner is None else iter(runner.imap(gtask, items))
    try:
        for result in results:
            yield from result.batches
            result.raise_error()
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()


class Loader:
    """Iterates global batches `start, start+1, ...` of a plan, materialising owned rows only.

    Args:
      plan: the root `Batch` node.
      sources: one record source, a list (index = `Source.id`) or a mapping id -> source.
      transforms: applied in every lane, in order.
      seed: seeds data-derived randomness (`RandomMap`); part of the state's identity.
      rank, world: data-parallel rank and degree; `plan.lanes.count % world == 0`.
      runner: executes steps (`zephon.runners.inline()` by default, or `threads(n)`,
        `processes(n)`); changes speed, never data. `close()` closes it.
      start_step: first global batch.
      read_ahead: rows one group read aims for (default `READ_AHEAD_ROWS`, capped at
        `READ_AHEAD_BYTES`); consecutive steps are read together. Changes speed, never data.
    """

    def __init__(self, plan: Batch, sources: RecordSource | Sequence[RecordSource] | Mapping[int, RecordSource],
                 transforms: Sequence[Transform] = (), *, seed: int = 0, rank: int = 0, world: int = 1,
                 runner: Any = None, start_step: int = 0, read_ahead: int | None = None) -> None:
        if not isinstance(plan, Batch):
            raise PlanError("Loader needs a complete plan: stream.lanes(L).batch(B)")
        self.plan = plan
        self.sources = as_source_map(sources)
        for s in _leaf_sources(plan):
            if s.id not in self.sources:
                raise PlanError(f"the plan reads Source id {s.id} ({s.name or 'unnamed'}) but no record "
                                f"source was given for it; pass sources as a list or {{id: source}}.")
            if len(self.sources[s.id]) < s.size:
                raise PlanError(f"Source id {s.id} declares {s.size} records but its record source "
                                f"has {len(self.sources[s.id])}; build the plan from len(source).")
        self.transforms = tuple(transforms)
        self.seed = int(seed)
        self.rank, self.world = int(rank), int(world)
        self.owned = plan.lanes.owned(self.rank, self.world)
        self.one_to_one = all(t.one_to_one for t in self.transforms)
        self.runner = runner
        self._task = StepTask(plan, self.sources, self.transforms, self.owned, self.seed)
        self._pending: Iterator[Columns] | None = None
        self.read_ahead = READ_AHEAD_ROWS if read_ahead is None else int(read_ahead)
        if self.read_ahead < 1:
            raise PlanError(f"read_ahead must be a positive number of rows, got {read_ahead!r}")
        self._step = 0
        self._lane_states: dict[int, LaneState] = {}
        self.seek(start_step) if self.one_to_one else self._reset_lanes(start_step)

    # --- iteration ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The next global batch this loader will yield."""
        return self._step

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> LocalBatch:
        n = self.plan.num_steps if self.one_to_one else None
        if n is not None and self._step >= n:
            raise StopIteration
        if self.one_to_one:
            if self._pending is None:
                self._pending = self._start_pending(self._step)
            try:
                cols = next(self._pending)
            except BaseException:
                self._stop_pending()  # the next call starts afresh at the same step
                raise
        else:
            cols = self._stateful_step()
        batch = LocalBatch(self._step, cols, self.owned, self.plan.per_lane, self.plan.size)
        self._step += 1
        return batch

    def _start_pending(self, start: int) -> Iterator[Columns]:
        return _iterate(self._task, self.runner, start, self.read_ahead)

    def _stop_pending(self) -> None:
        pending, self._pending = self._pending, None
        closer = getattr(pending, "close", None)
        if closer is not None:
            closer()

    def strided(self, start: int, stride: int) -> Iterator[LocalBatch]:
        """Batches start, start+stride, ... with grouped reads, for splitting steps among
        workers (worker w of W takes `strided(first + w, W)`). Leaves `self.step` alone."""
        if not self.one_to_one:
            raise PlanError("strided iteration needs a one-to-one pipeline; a filter advances "
                            "its lanes sequentially.")
        n = self.plan.num_steps
        if n is not None and start >= n:
            return
        for k, cols in enumerate(_iterate(self._task, self.runner, start, self.read_ahead, stride)):
            yield LocalBatch(start + k * stride, cols, self.owned, self.plan.per_lane, self.plan.size)

    def batch(self, step: int) -> LocalBatch:
        """Random access to global batch `step` (one-to-one pipelines only)."""
        if not self.one_to_one:
            raise PlanError("random access needs a one-to-one pipeline; with a filter, iterate "
                            "or restore a saved state instead.")
        return LocalBatch(step, self._task(step), self.owned, self.plan.per_lane, self.plan.size)

    def close(self) -> None:
        """Stops prefetching and closes the runner (its workers and shared memory)."""
        self._stop_pending()
        closer = getattr(self.runner, "close", None)
        if closer is not None:
            closer()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- stateful lanes (count-changing pipelines) ---------------------------------------------
    def _reset_lanes(self, step: int) -> None:
        if step != 0:
            raise StateError(f"a pipeline with a filter cannot start at step {step} without saved "
                             "lane states; restore a state saved by `state()` instead.")
        self._step = 0
        self._lane_states = {int(l): LaneState(0) for l in self.owned}

    def _stateful_step(self) -> Columns:
        """Fills per_lane outputs for every owned lane, advancing cursors exactly past what's used."""
        lanes_node = self.plan.lanes
        per = self.plan.per_lane
        limit = lanes_node.lane_length()
        owned = self.owned
        cur = np.array([self._lane_states[int(l)].cursor for l in owned], np.int64)
        need = np.full(len(owned), per, np.int64)
        parts: list[tuple[np.ndarray, np.ndarray, Columns]] = []  # (lane rank, order, cols)
        ratio = 1.0
        while need.any():
            act = np.flatnonzero(need)
            chunk = np.ceil(need[act] / max(ratio, 1 / 64)).astype(np.int64)
            if limit is not None:
                chunk = np.minimum(chunk, limit - cur[act])
                if (chunk <= 0).any():
                    raise StopIteration
            lane_rank = np.repeat(act, chunk)
            starts = np.repeat(np.cumsum(chunk) - chunk, chunk)
            index = np.repeat(cur[act], chunk) + np.arange(chunk.sum()) - starts
            refs = lanes_node.resolve(lanes_node.stream_positions(owned[lane_rank], index))
            cols, kept = run_transforms(self.transforms, read_refs(self.sources, refs), refs, self.seed)
            k_lane = lane_rank[kept]
            # rank of each kept row among its lane's kept rows in this pass
            first = np.searchsorted(k_lane, k_lane, side="left")
            nth = np.arange(len(k_lane)) - first
            take = nth < need[k_lane]
            sel = kept[take]
            if take.any():  # a pass that kept nothing may not even carry the columns' schema
                parts.append((k_lane[take], index[sel], {k: v[take] for k, v in cols.items()}))
            got = np.bincount(k_lane[take], minlength=len(owned))
            done = act[got[act] == need[act]]
            # satisfied lanes resume right after their last used input; others after the chunk
            last = np.full(len(owned), -1, np.int64)
            np.maximum.at(last, lane_rank[sel], index[sel])
            cur[done] = last[done] + 1
            short = act[got[act] < need[act]]
            cur[short] += chunk[np.searchsorted(act, short)]
            need -= got
            ratio = max(len(kept), 1) / max(len(refs), 1)
        lane_rank = np.concatenate([p[0] for p in parts])
        order = np.lexsort((np.concatenate([p[1] for p in parts]), lane_rank))
        cols = {k: np.concatenate([p[2][k] for p in parts])[order] for k in parts[0][2]}
        self._lane_states = {int(l): LaneState(int(c), self._lane_states[int(l)].carry)
                             for l, c in zip(owned, cur)}
        return cols

    # --- state ---------------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {"plan_fingerprint": self.plan.fingerprint(), "seed": self.seed,
                "pipeline": [t.name for t in self.transforms]}

    def state(self) -> dict[str, Any]:
        """JSON state after the last yielded batch: identity, step, owned lanes' states."""
        if self.one_to_one:
            lanes = {str(int(l)): LaneState(self._step * self.plan.per_lane).to_json() for l in self.owned}
        else:
            lanes = {str(l): s.to_json() for l, s in self._lane_states.items()}
        return {"zephon_state": STATE_VERSION, **self._identity(), "plan": self.plan.to_json(),
                "step": self._step, "lanes": lanes}

    def seek(self, step: int) -> None:
        """Positions a one-to-one pipeline at `step` in O(1)."""
        if not self.one_to_one:
            raise StateError("seek() needs a one-to-one pipeline; restore a saved state instead.")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise PlanError(f"step must be a non-negative integer, got {step!r}")
        self._stop_pending()
        self._step = int(step)

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues from `state` (saved at any data-parallel degree of the same plan)."""
        if not isinstance(state, Mapping) or state.get("zephon_state") != STATE_VERSION:
            raise StateError("not a Zephon loader state (missing 'zephon_state': "
                             f"{STATE_VERSION}); pass the dict that Loader.state() returned.")
        mine = self._identity()
        if state.get("plan_fingerprint") != mine["plan_fingerprint"]:
            diffs = plan_diff(state.get("plan"), self.plan.to_json())
            raise StateError("this checkpoint was written by another plan (fingerprint "
                             f"{state.get('plan_fingerprint')} != {mine['plan_fingerprint']}); "
                             f"differences: {'; '.join(diffs[:5]) or 'unknown'}. Restore it with the "
                             "plan that wrote it, or start this plan from step 0.")
        for key in ("seed", "pipeline"):
            if state.get(key) != mine[key]:
                raise StateError(f"this checkpoint's {key} {state.get(key)!r} differs from the "
                                 f"loader's {mine[key]!r}; use the same {key} to resume.")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateError(f"checkpoint step {step!r} is not a non-negative integer")
        lanes = state.get("lanes", {})
        if self.one_to_one:
            self.seek(step)
            return
        missing = [int(l) for l in self.owned if str(int(l)) not in lanes]
        if missing:
            raise StateError(f"the state lacks lanes {missing[:8]}{'...' if len(missing) > 8 else ''} "
                             "that this rank owns; merge every rank's state with merge_states() "
                             "before restoring at a different data-parallel degree.")
        self._stop_pending()
        self._step = step
        self._lane_states = {int(l): LaneState.from_json(lanes[str(int(l))]) for l in self.owned}


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Unions the lane states of every rank's `state()` taken at the same step."""
    if not states:
        raise StateError("merge_states needs at least one state")
    head = dict(states[0])
    for s in states[1:]:
        for key in ("plan_fingerprint", "seed", "pipeline", "step"):
            if s.get(key) != head.get(key):
                raise StateError(f"cannot merge states with different {key}: "
                                 f"{s.get(key)!r} != {head.get(key)!r}")
    head["lanes"] = {k: v for s in states for k, v in s["lanes"].items()}
    return head


def save_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Writes `state` as JSON atomically (temp file, fsync, rename): never a torn checkpoint."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".zephon-state-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a state written by `save_state` (JSON only; nothing is unpickled)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise StateError(f"no loader state at {os.fspath(path)}; check the checkpoint directory") from None
    except json.JSONDecodeError as e:
        raise StateError(f"loader state {os.fspath(path)} is not valid JSON ({e}); the file is "
                         "corrupt — restore an earlier checkpoint.") from e

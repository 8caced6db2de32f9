"""Windows: the parallel half of the lane engine.

Inputs `[start + offset(w), ...)` of every owned lane are resolved by the algebra, read with one
vectorised read per source and put through the row operators. Row operators carry nothing, so a
window is a pure function of `(branch, w)`: any runner computes windows ahead, in any thread or
process, and the result cannot depend on which. Window lengths double from a small first one, so
the first batch comes quickly and later reads are large; where windows fall changes speed only.

Terms (docs/glossary.md): window, branch, cursor.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon.errors import PlanError, StateError
from zephon.exec.steps import raise_captured, read_refs
from zephon.ops.base import Transform, run_transforms, sub_index
from zephon.plan import Lanes, Refs
from zephon.sources.base import Columns, RecordSource
from zephon.sources.columns import objects
from zephon.telemetry import column_bytes

Provenance = tuple[int, int, int, int, int, int]  # (branch, input, output, source, record, epoch)
#: `(branch, w, lo, count)`: window w of a branch reads `count[k]` inputs from `lo[k]` of lane k
LaneItem = tuple[int, int, np.ndarray, np.ndarray]


@dataclass
class Window:
    """Outputs of the row operators over inputs `[start, start + size)` of every owned lane.

    Rows are lane-major, in input order. `bounds[k]:bounds[k+1]` are lane k's rows; `ended[k]`
    is true when lane k's inputs ran out inside this window (a finite plan).
    """

    branch: int
    number: int
    cols: Columns
    index: np.ndarray
    sub: np.ndarray
    refs: Refs
    bounds: np.ndarray
    ended: np.ndarray
    error: BaseException | None = None
    traceback: str = ""
    #: telemetry (`zephon.telemetry`): seconds reading, seconds in row operators, bytes read
    read_s: float = 0.0
    ops_s: float = 0.0
    nbytes: int = 0
    #: per lane, the first row not yet taken: set by the engine when it takes the window up
    used: np.ndarray = field(init=False, repr=False, compare=False)

    def raise_error(self) -> None:
        raise_captured(self.error, self.traceback)

    # A window travels from a worker process as a pickle: a column of documents (one token
    # array a row) goes as one array and its lengths, not as a pickled array a row, and comes
    # back as views of that array (the consumer unpickled thousands of small arrays a window).
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "cols": {k: _Ragged.of(v) or v for k, v in self.cols.items()}}

    def __setstate__(self, d: dict[str, Any]) -> None:
        d["cols"] = {k: v.column() if isinstance(v, _Ragged) else v for k, v in d["cols"].items()}
        self.__dict__.update(d)


@dataclass(frozen=True)
class _Ragged:
    """An object column of 1-D arrays of one dtype, as their concatenation and lengths."""

    flat: np.ndarray
    lengths: np.ndarray

    @staticmethod
    def of(col: np.ndarray) -> _Ragged | None:
        if col.dtype != object or col.ndim != 1 or not len(col):
            return None
        first = col[0]
        if type(first) is not np.ndarray or first.dtype.kind not in "biuf":
            return None
        dt = first.dtype
        if not all(type(x) is np.ndarray and x.ndim == 1 and x.dtype == dt for x in col):
            return None
        return _Ragged(np.concatenate(list(col)), np.fromiter(map(len, col), np.int64, len(col)))

    def column(self) -> np.ndarray:
        return objects(np.split(self.flat, np.cumsum(self.lengths)[:-1]))


@dataclass(frozen=True)
class WindowTask:
    """`item -> Window`: pure and picklable; what a runner maps over. An item is `(branch, w)`
    (the same inputs of every lane, the simple path) or a `LaneItem` naming each lane's inputs
    (the general path, `zephon.exec.feed`)."""

    lanes: Lanes
    sources: Mapping[int, RecordSource]
    rows: tuple[Transform, ...]
    owned: np.ndarray
    seed: int
    starts: tuple[np.ndarray, ...]
    size: int
    first: int = 0
    #: per branch, the inputs each owned lane has (None: infinite); see `Lanes.lane_limits`
    limits: tuple[np.ndarray | None, ...] = ()
    epoch: int = 0

    def span(self, w: int) -> tuple[int, int]:
        """(offset, length) of window w in every lane: lengths double from `first` up to
        `size`, so the first batch comes quickly and later reads are large."""
        first = max(1, min(self.first or self.size, self.size))
        k = 0
        while first << k < self.size and k < w:
            k += 1
        if k == w:  # still in the doubling phase
            return first * ((1 << w) - 1), min(first << w, self.size)
        ramp = first * ((1 << k) - 1)
        return ramp + (w - k) * self.size, self.size

    def __call__(self, item: tuple[int, int] | LaneItem) -> Window:
        """Window `item`: `(branch, w)` reads the same inputs of every lane (`span(w)`); a
        `LaneItem` `(branch, w, lo, count)` reads `count[k]` inputs from `lo[k]` of lane k."""
        n = len(self.owned)
        if len(item) == 2:
            branch, w = item
            offset, size = self.span(w)
            lo = self.starts[branch] + offset
            want = np.full(n, size, np.int64)
        else:
            branch, w, lo, want = item
        count = want
        limit = self.limits[branch] if self.limits else self.lanes.branch_length(branch)
        if limit is not None:
            count = np.clip(limit - lo, 0, want)
        ended = count < want
        lane_rank = np.repeat(np.arange(n, dtype=np.int64), count)
        index = lo[lane_rank] + (np.arange(count.sum(), dtype=np.int64)
                                 - np.repeat(np.cumsum(count) - count, count))
        try:
            refs = self.lanes.resolve_lanes(self.owned[lane_rank], index, branch, self.epoch)
            t0 = t1 = time.perf_counter()
            nbytes = 0
            if len(refs):
                read = read_refs(self.sources, refs)
                t1 = time.perf_counter()
                nbytes = column_bytes(read)
                cols, src = run_transforms(self.rows, read, refs, self.seed)
            else:  # past a finite lane's end: nothing to read or transform
                cols, src = {}, np.zeros(0, np.int64)
            t2 = time.perf_counter()
        except Exception as e:
            empty = np.zeros(0, np.int64)
            return Window(branch, w, {}, empty, empty, Refs(empty, empty, empty),
                          np.zeros(n + 1, np.int64), ended, e, traceback.format_exc())
        lane_out = lane_rank[src]
        bounds = np.searchsorted(lane_out, np.arange(n + 1), side="left").astype(np.int64)
        return Window(branch, w, cols, index[src], sub_index(src), refs.take(src), bounds, ended,
                      read_s=t1 - t0, ops_s=t2 - t1, nbytes=nbytes)


def window_size(read_ahead: int, lanes: int, per_lane: int) -> int:
    """Inputs per lane in one window: about `read_ahead` rows over all owned lanes."""
    return max(per_lane, read_ahead // max(1, lanes))


def take_rows(cols: Columns, rows: np.ndarray) -> Columns:
    return {k: v[rows] for k, v in cols.items()}


def concat_cols(parts: Sequence[Columns]) -> Columns:
    parts = [p for p in parts if p]
    if not parts:
        return {}
    if len(parts) == 1:
        return parts[0]
    names = parts[0].keys()
    out: Columns = {}
    for k in names:
        vs = [p[k] for p in parts]
        if any(v.dtype == object for v in vs) and not all(v.dtype == object for v in vs):
            vs = [v.astype(object) if v.dtype != object else v for v in vs]
        try:
            out[k] = np.concatenate(vs)
        except ValueError as e:
            shapes = sorted({f"{v.dtype}{v.shape[1:]}" for v in vs})
            raise PlanError(f"field {k!r} comes as {shapes} in different rows of one lane; map every "
                            "source to one schema (fixed shapes, or ragged object columns).") from e
    return out


def rematerialize(task: WindowTask, states: Sequence[Any]
                  ) -> list[tuple[Columns, list[Provenance]]]:
    """Re-reads and re-processes the inputs each lane's accumulator holds (after a restore).

    One read per branch over all lanes' held inputs; the work is O(lanes × held), not O(steps).
    """
    out: list[tuple[Columns, list[Provenance]]] = [({}, []) for _ in states]
    for b in range(len(task.starts)):
        want = [(k, i, h) for k, st in enumerate(states) for i, h in enumerate(st.held) if h[0] == b]
        if not want:
            continue
        lane = np.array([task.owned[k] for k, _, _ in want], np.int64)
        index = np.array([h[1] for _, _, h in want], np.int64)
        refs = task.lanes.resolve_lanes(lane, index, b, task.epoch)
        cols, src = run_transforms(task.rows, read_refs(task.sources, refs), refs, task.seed)
        sub = sub_index(src)
        for j, (k, _, h) in enumerate(want):
            hit = np.flatnonzero((src == j) & (sub == h[2]))
            if not hit.size:
                raise StateError(f"lane {int(task.owned[k])} holds output {h[2]} of input {h[1]} "
                                 "but re-processing that input gives fewer outputs: the data or "
                                 "the pipeline changed since the checkpoint.")
            r = int(hit[0])
            row = take_rows(cols, np.array([r]))
            prev_cols, prev = out[k]
            out[k] = (concat_cols([prev_cols, row]) if prev_cols else row,
                      prev + [(b, h[1], h[2], int(refs.source[j]), int(refs.record[j]), int(refs.epoch[j]))])
    # held inputs were gathered branch by branch: put them back in each lane's hold order
    for k, st in enumerate(states):
        if len({h[0] for h in st.held}) > 1:
            cols, prov = out[k]
            key = {(p[0], p[1], p[2]): i for i, p in enumerate(prov)}
            order = np.array([key[tuple(h)] for h in st.held], np.int64)
            out[k] = (take_rows(cols, order), [prov[i] for i in order])
    return out


def private_copy(cols: Columns) -> Columns:
    """Columns that own their memory: arrays copied, and in object columns every array element
    (a document's tokens) too — a view would keep the shared-memory slot it came in alive."""
    out: Columns = {}
    for name, v in cols.items():
        if v.dtype == object and v.ndim == 1:
            out[name] = objects([x.copy() if isinstance(x, np.ndarray) else x for x in v])
        else:
            out[name] = v.copy()
    return out


def privatize(win: Window) -> None:
    """Every array of `win` copied out of the memory it arrived in (see `private_copy`)."""
    win.cols = private_copy(win.cols)
    win.index, win.sub = win.index.copy(), win.sub.copy()
    win.bounds, win.ended = win.bounds.copy(), win.ended.copy()
    r = win.refs
    win.refs = Refs(r.source.copy(), r.record.copy(), r.epoch.copy(), {k: v.copy() for k, v in r.extra.items()})

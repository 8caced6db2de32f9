"""The lane engine: count-changing pipelines, run in parallel, assembled in lane order.

Every lane is an independent sequential stream. The engine splits the work on it in two:

1. **Windows (parallel).** Inputs `[start + w·C, start + (w+1)·C)` of every owned lane, for
   w = 0, 1, ..., are resolved by the algebra, read with one vectorised read per source, and put
   through the row operators (decode, map, filter, tokenize...). Row operators carry nothing, so a
   window is a pure function of `(branch, w)`: any runner (threads, processes) computes windows
   ahead, in any worker, and the result cannot depend on which. (With a token mix or an
   accumulator, lanes drift apart, so each window reads each lane from its own frontier instead:
   `exec/feed.py`.)
2. **Assembly (sequential, cheap).** In the consumer, each lane takes its next outputs from the
   windows in order: `B/L` rows a step, through the token-mix schedule (`exec/schedule.py`) and
   an accumulator (packing) if the pipeline has them. Only this part carries state, and the state is positions:
   per branch the lane's next input and how many of its outputs were used (`cursor`, `skip`),
   the mix counters, and the accumulator's carry with the inputs it holds named by position.

So the data a lane emits depends on the plan and the lane only: not on the runner, the window
size, the number of lanes a rank owns, or where a run was stopped. A restore re-reads the few
inputs the carries hold (`rematerialize`) and starts windows at the saved cursors: its cost is
O(lanes × carry), whatever the step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import PlanError, StateError
from zephon.exec.feed import LaneFeed
from zephon.exec.padding import fill_blanks
from zephon.exec.perlane import PerLaneAssembly
from zephon.exec.pipeline import LanePipeline
from zephon.exec.schedule import TokenSchedule
from zephon.exec.state import LaneState, canonical
from zephon.exec.steps import Sink
from zephon.exec.windows import LaneItem, Provenance, Window, WindowTask, privatize, rematerialize, window_size
from zephon.plan import Batching, Mix, Refs
from zephon.sources.base import Columns, RecordSource

if TYPE_CHECKING:  # annotation only: importing zephon.runners here would load it with the core
    from zephon.runners.base import Runner

log = logging.getLogger(__name__)


#: Pending windows per branch whose columns may stay in a runner's shared memory (older ones are
#: copied out: see `LaneEngine._use`).
_SHARED_WINDOWS = 3


# --- the engine: the sequential part -------------------------------------------------------------
class LaneEngine(PerLaneAssembly):
    """Produces the owned rows of consecutive steps of a count-changing pipeline.

    `states` are the owned lanes' `LaneState`s at the first step, `step` (needed by a weight
    schedule), `epoch` the pass over a finite plan; `next()` returns the next step's columns
    (lane-major), the provenance of its rows and their validity, and updates `states`. A lane
    whose inputs ran out pads its rows (invalid) until every owned lane ran out.
    """

    def __init__(self, plan: Batching, sources: Mapping[int, RecordSource], pipeline: LanePipeline,
                 owned: np.ndarray, seed: int, runner: Runner | None, read_ahead: int,
                 states: Sequence[LaneState], step: int = 0, epoch: int = 0) -> None:
        self.plan, self.sources, self.pipeline = plan, sources, pipeline
        self.owned, self.seed = owned, seed
        self.step = step
        lanes = plan.lanes
        self.nb = len(lanes.branches)
        mix = lanes.child if isinstance(lanes.child, Mix) and lanes.child.sequential else None
        self.schedule = None if mix is None else TokenSchedule.of(mix)
        self._asm_step = step  # the step the simple path assembles next
        self._states = list(states)
        self._simple: tuple[np.ndarray, np.ndarray] | None = None  # (cursor, skip) of the simple path
        self._ready: deque[tuple[Columns, Refs, tuple[np.ndarray, np.ndarray], np.ndarray]] = deque()
        #: steps the simple path assembles in one pass (bounded like a group read)
        largest = plan.sizes.largest // lanes.count  # a batch-size ramp's largest share of a lane
        self._group = max(1, min(64, read_ahead // max(1, len(owned) * largest)))
        starts = tuple(np.array([s.cursor[b] for s in self._states], np.int64) for b in range(self.nb))
        size = window_size(read_ahead, len(owned), largest)
        first = plan.per_lane_at(step)
        if self.schedule is not None or pipeline.acc is not None:
            # documents (tokenize, pack): ~128 inputs a window keep encode_batch efficient and
            # spread across processes' windows, while several windows are in flight on the runner
            size = max(8, min(size, 128 // max(1, len(owned))))
            first = 2
        self.limits = tuple(lanes.lane_limits(owned, b, plan.pad) for b in range(self.nb))
        self.task = WindowTask(lanes, sources, pipeline.rows, owned, seed, starts, size, first,
                               self.limits, epoch)
        #: the general path reads each lane from its own frontier (bounded memory under drift);
        #: the simple path takes every lane's rows in lock-step, so its windows read all lanes
        self.feed = (LaneFeed(starts, self.limits, first, size)
                     if self.schedule is not None or pipeline.acc is not None else None)
        self.pending: list[deque[Window]] = [deque() for _ in range(self.nb)]
        self._copied: set[tuple[int, int]] = set()  # pending windows already out of shared memory
        self.issued = [0] * self.nb
        self.want = [0.0] * self.nb  # windows each branch is expected to need next
        self._ended = [np.zeros(len(owned), bool) for _ in range(self.nb)]
        self._runner = runner
        self._results: Iterator[Window] | None = None
        self.sink: Sink | None = None  # set by the Loader when telemetry is on
        self._skip_applied = False
        period = lanes.child.period if self.nb == 1 else None
        #: inputs of one epoch in a lane, for the never-outputs guard (None: no epochs)
        self._epoch = None if period is None else -(-period // lanes.count)
        self._dry_limit = 0 if self._epoch is None else max(64 * self._epoch, 1 << 16)
        self._dry = np.zeros(len(owned), np.int64)
        self._checked = -1  # the last window number the guard counted (windows come in order)
        self._held: list[tuple[Columns, list[Provenance]]] = []
        if pipeline.acc is not None:
            self._held = rematerialize(self.task, self.states)
            for lane, st, (cols, _) in zip(owned, self._states, self._held):
                try:
                    pipeline.acc.check_carry(st.carry, cols)
                except (ValueError, TypeError, KeyError) as e:
                    raise StateError(f"lane {int(lane)} of the state has a 'carry' that "
                                     f"{pipeline.acc.op_name} cannot continue from: {e}. The state "
                                     "was edited or belongs to another pipeline.") from None

    @property
    def states(self) -> list[LaneState]:
        """The owned lanes' states after the last step (built on demand: a step only updates
        arrays on the simple path)."""
        if self._simple is not None:
            cur, skip = self._simple
            self._states = [LaneState((int(c),), (int(k),)) for c, k in zip(cur, skip)]
            self._simple = None
        return self._states

    # --- windows ------------------------------------------------------------------------------
    def _items(self) -> Iterator[tuple[int, int] | LaneItem]:
        while True:
            if self.nb == 1:
                b = 0
            else:  # the branch whose look-ahead is smallest relative to what it is used at
                b = min(range(self.nb), key=lambda i: (self.issued[i] - self.want[i], i))
            yield self._item(b)

    def _item(self, b: int) -> tuple[int, int] | LaneItem:
        w = self.issued[b]
        self.issued[b] += 1
        if self.feed is None:
            return b, w
        unused = sum((win.bounds[1:] - win.used for win in self.pending[b]), np.zeros(len(self.owned), np.int64))
        return self.feed.item(b, w, unused)

    def _pull(self, branch: int) -> None:
        """Receives windows until one of `branch` arrives (others are kept for later)."""
        if self._results is None:
            # the first window of every branch is computed here, while the runner's workers
            # start: the first batch comes as fast as one window can be read
            for b in range(self.nb):
                t0 = time.perf_counter()
                self._receive(self.task(self._item(b)), t0)
            items = self._items()
            self._results = (map(self.task, items) if self._runner is None
                             else iter(self._runner.imap(self.task, items)))
            return
        while True:
            self.want[branch] += 1
            t0 = time.perf_counter()
            win = next(self._results)
            self._receive(win, t0)
            if win.branch == branch:
                return

    def _receive(self, win: Window, t0: float) -> None:
        if self.sink is not None:  # telemetry: the window's stage times, how long we waited
            self.sink(win, time.perf_counter() - t0)
        win.used = win.bounds[:-1].copy()
        self.pending[win.branch].append(win)
        if self.feed is not None:
            self.feed.received(win)

    def _peek(self, b: int, k: int, count: int) -> list[tuple[Window, int]]:
        """The next `count` unused rows of branch b for lane k (fewer if the lane ended)."""
        return self._arrived(b, k, count, count)[0]

    def _arrived(self, b: int, k: int, least: int, most: int) -> tuple[list[tuple[Window, int]], bool]:
        """Lane k's next unused rows of branch b in windows that have arrived, up to `most`;
        windows are pulled only while there are fewer than `least`. Also whether the lane's
        inputs end with these rows."""
        out: list[tuple[Window, int]] = []
        wi = 0
        while len(out) < most:
            if wi == len(self.pending[b]):
                if self._ended[b][k]:
                    return out, True
                if len(out) >= least:
                    break
                if self.feed is not None:
                    self.feed.ask(b, k)
                self._pull(b)
            win = self.pending[b][wi]
            win.raise_error()
            self._ended[b] |= win.ended
            lo, hi = int(win.used[k]), int(win.bounds[k + 1])
            out += [(win, r) for r in range(lo, min(hi, lo + most - len(out)))]
            wi += 1
        return out, False

    def _use(self, b: int, k: int, count: int) -> None:
        for win in self.pending[b]:
            if not count:
                break
            t = min(count, int(win.bounds[k + 1] - win.used[k]))
            win.used[k] += t
            count -= t
        pending = self.pending[b]
        while pending and np.all(pending[0].used >= pending[0].bounds[1:]):
            self._copied.discard((b, pending.popleft().number))
        # Lanes drift apart in a branch (a token mix, filters), so old windows stay pending for
        # the slowest lanes. A window's columns may be views of a runner's shared memory, which
        # cannot be reused while they live: past the newest few, windows are copied once, so the
        # shared memory in use stays bounded however far the lanes drift.
        for i in range(len(pending) - _SHARED_WINDOWS):
            win = pending[i]
            if (b, win.number) not in self._copied:
                privatize(win)
                self._copied.add((b, win.number))

    def close(self) -> None:
        results, self._results = self._results, None
        closer = getattr(results, "close", None)
        if closer is not None:
            closer()

    # --- the simple path: no mix, no accumulator ----------------------------------------------
    def _apply_skip(self) -> None:
        """Drops outputs a restored lane had already used of its first input (flat maps)."""
        self._skip_applied = True
        skip = np.array([s.skip[0] for s in self.states], np.int64)
        if not skip.any():
            return
        if not self.pending[0]:
            self._pull(0)
        win = self.pending[0][0]  # a lane's first input lies in the first window
        win.raise_error()
        for k in np.flatnonzero(skip):
            rows = np.arange(win.used[k], win.bounds[k + 1])
            first = rows[(win.index[rows] == self.states[k].cursor[0]) & (win.sub[rows] < skip[k])]
            win.used[k] += len(first)

    def _check_dry(self, win: Window, got: np.ndarray, wanted: np.ndarray) -> None:
        """Raises when a lane read 64 epochs of its inputs (at least 65,536) without one output:
        its filter rejects everything it sees, and waiting would hang the training loop."""
        if self._epoch is None:
            return
        if win.number <= self._checked:
            return
        self._checked = win.number
        span = self.task.span(win.number)[1]
        self._dry = np.where(got | ~wanted, 0, self._dry + span)
        bad = np.flatnonzero(self._dry > self._dry_limit)
        if bad.size:
            lane = int(self.owned[bad[0]])
            raise PlanError(f"lane {lane} read {int(self._dry[bad[0]])} inputs (an epoch of it holds "
                            f"{self._epoch}) without one record passing {self._why()}: it will "
                            "not fill a batch. Check the filter, or deal the data into lanes "
                            "differently (lanes(L) deals positions l, l+L, ...; shuffle before lanes()).")

    def _why(self) -> str:
        return ", ".join(t.op_name for t in self.pipeline.rows if not t.one_to_one) or "the pipeline"

    def _simple_steps(self) -> None:
        """Assembles as many steps as the fetched windows hold (at least one) in one vectorised
        pass, into `self._ready`: per step its columns (views), refs, positions and validity.
        A lane that ran out fills its rows with padding; StopIteration once every lane ran out."""
        if not self._skip_applied:
            self._apply_skip()
        n, per = len(self.owned), self.plan.per_lane_at(self._asm_step)
        ended = self._ended[0]
        avail = sum((w.bounds[1:] - w.used for w in self.pending[0]), np.zeros(n, np.int64))
        live = avail[~ended]
        ahead = live.min() // per if live.size else -(-int(avail.max(initial=0)) // per)
        steps = int(max(1, min(self._group, ahead)))
        end = self.plan.sizes.stretch_end(self._asm_step)  # one pass assembles steps of one size
        if end is not None:
            steps = min(steps, end - self._asm_step)
        need0 = steps * per
        need = np.full(n, need0, np.int64)
        parts: list[tuple[Window, np.ndarray, np.ndarray]] = []
        index_at = np.empty((n, need0), np.int64)
        sub_at = np.empty((n, need0), np.int64)
        wi = 0
        while need.any():
            if wi == len(self.pending[0]):
                if self._ended[0][need > 0].all():
                    break  # the lanes still short ran out: the rest of their rows are padding
                self._pull(0)
            win = self.pending[0][wi]
            win.raise_error()
            take = np.minimum(win.bounds[1:] - win.used, need)
            self._check_dry(win, take > 0, need > 0)
            if take.any():
                tot = int(take.sum())
                within = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(take) - take, take)
                lane = np.repeat(np.arange(n, dtype=np.int64), take)
                idx = win.used[lane] + within
                pos = (need0 - need)[lane] + within
                parts.append((win, idx, (pos // per) * (n * per) + lane * per + pos % per))
                index_at[lane, pos], sub_at[lane, pos] = win.index[idx], win.sub[idx]
                win.used += take
                need -= take
            self._ended[0] |= win.ended
            if need.any():
                wi += 1
        while self.pending[0] and np.all(self.pending[0][0].used >= self.pending[0][0].bounds[1:]):
            self.pending[0].popleft()
        got = need0 - need
        if not got.any():
            raise StopIteration  # every lane ran out
        steps = -(-int(got.max()) // per)  # steps with at least one valid row
        need0 = steps * per
        valid = np.arange(need0)[None, :] < got[:, None]  # (lane, output)
        short = np.flatnonzero(got < need0)
        if short.size:  # a lane that ran out is at its end: (inputs, 0)
            limit = self.limits[0]
            assert limit is not None
            pad = ~valid[short]
            index_at[short, :need0] = np.where(pad, limit[short, None], index_at[short, :need0])
            sub_at[short, :need0] = np.where(pad, -1, sub_at[short, :need0])
        total = steps * n * per
        out: Columns = {}
        ref = np.full((3, total), -1, np.int64)
        for win, idx, dest in parts:
            for k, v in win.cols.items():
                if k not in out:
                    out[k] = (np.empty if not short.size else np.zeros)((total,) + v.shape[1:], dtype=v.dtype)
                elif out[k].dtype != v.dtype and out[k].dtype != object and v.dtype == object:
                    out[k] = out[k].astype(object)
                out[k][dest] = v[idx]
            ref[0, dest], ref[1, dest], ref[2, dest] = win.refs.source[idx], win.refs.record[idx], win.refs.epoch[idx]
        flat_valid = valid.reshape(n, steps, per).transpose(1, 0, 2).reshape(-1)
        if short.size:
            fill_blanks(out, np.flatnonzero(~flat_valid))
        expands = self.pipeline.expands
        rows = n * per
        for s in range(steps):
            last = (s + 1) * per - 1
            position = canonical(index_at[:, last], sub_at[:, last] + 1, expands)
            view = slice(s * rows, (s + 1) * rows)
            self._ready.append(({k: v[view] for k, v in out.items()},
                                Refs(ref[0, view], ref[1, view], ref[2, view]), position, flat_valid[view]))
        self._asm_step += steps

    def next(self) -> tuple[Columns, Any, np.ndarray]:
        """The next step's owned rows (lane-major), their provenance (refs, or per packed row
        its segments) and validity (False: padding of a lane that ran out). StopIteration once
        every owned lane ran out."""
        if self.schedule is None and self.pipeline.acc is None:
            if not self._ready:
                self._simple_steps()
            cols, refs, self._simple, valid = self._ready.popleft()
            return cols, refs, valid
        return self._general_step()

    def mark(self) -> tuple[Any, ...]:
        """The engine's position now, for `states_at` (cheap: references, no copies)."""
        return (self._states, self._simple)

    @staticmethod
    def states_at(mark: tuple[Any, ...]) -> list[LaneState]:
        """The lanes' states at a `mark()`."""
        states, simple = mark
        if simple is None:
            return list(states)
        return [LaneState((int(c),), (int(k),)) for c, k in zip(*simple)]

"""The lane engine: count-changing pipelines, run in parallel, assembled in lane order.

Every lane is an independent sequential stream. The engine splits the work on it in two:

1. **Windows (parallel).** Inputs `[start + w·C, start + (w+1)·C)` of every owned lane, for
   w = 0, 1, ..., are resolved by the algebra, read with one vectorised read per source, and put
   through the row operators (decode, map, filter, tokenize...). Row operators carry nothing, so a
   window is a pure function of `(branch, w)`: any runner (threads, processes) computes windows
   ahead, in any worker, and the result cannot depend on which.
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
from zephon.exec.pipeline import LanePipeline
from zephon.exec.schedule import TokenSchedule
from zephon.exec.state import LaneState, canonical
from zephon.exec.steps import Sink
from zephon.exec.windows import (
    Provenance,
    Window,
    WindowTask,
    concat_cols,
    privatize,
    rematerialize,
    take_rows,
    window_size,
)
from zephon.plan import Batch, Mix, Refs
from zephon.sources.base import Columns, RecordSource

if TYPE_CHECKING:  # annotation only: importing zephon.runners here would load it with the core
    from zephon.runners.base import Runner

log = logging.getLogger(__name__)


#: Pending windows per branch whose columns may stay in a runner's shared memory (older ones are
#: copied out: see `LaneEngine._use`).
_SHARED_WINDOWS = 3


# --- the engine: the sequential part -------------------------------------------------------------
class LaneEngine:
    """Produces the owned rows of consecutive steps of a count-changing pipeline.

    `states` are the owned lanes' `LaneState`s at the first step, `step` (needed by a weight
    schedule); `next()` returns the next step's columns (lane-major), the provenance of its rows,
    and updates `states`.
    """

    def __init__(self, plan: Batch, sources: Mapping[int, RecordSource], pipeline: LanePipeline,
                 owned: np.ndarray, seed: int, runner: Runner | None, read_ahead: int,
                 states: Sequence[LaneState], step: int = 0) -> None:
        self.plan, self.sources, self.pipeline = plan, sources, pipeline
        self.owned, self.seed = owned, seed
        self.step = step
        lanes = plan.lanes
        self.nb = len(lanes.branches)
        mix = lanes.child if isinstance(lanes.child, Mix) and lanes.child.by_tokens else None
        self.schedule = None if mix is None else TokenSchedule.of(mix)
        self._asm_step = step  # the step the simple path assembles next
        self._states = list(states)
        self._simple: tuple[np.ndarray, np.ndarray] | None = None  # (cursor, skip) of the simple path
        self._ready: deque[tuple[Columns, Refs, tuple[np.ndarray, np.ndarray]]] = deque()
        #: steps the simple path assembles in one pass (bounded like a group read)
        largest = plan.sizes.largest // lanes.count  # a batch-size ramp's largest share of a lane
        self._group = max(1, min(64, read_ahead // max(1, len(owned) * largest)))
        starts = tuple(np.array([s.cursor[b] for s in self._states], np.int64) for b in range(self.nb))
        size = window_size(read_ahead, len(owned), largest)
        first = plan.per_lane_at(step)
        if self.schedule is not None or pipeline.acc is not None:
            # documents (tokenize, pack): ~512 inputs a window keep encode_batch efficient while
            # several windows are in flight on the runner
            size = max(8, min(size, 512 // max(1, len(owned))))
            first = 2
        self.task = WindowTask(lanes, sources, pipeline.rows, owned, seed, starts, size, first)
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
    def _items(self) -> Iterator[tuple[int, int]]:
        while True:
            if self.nb == 1:
                b = 0
            else:  # the branch whose look-ahead is smallest relative to what it is used at
                b = min(range(self.nb), key=lambda i: (self.issued[i] - self.want[i], i))
            item = (b, self.issued[b])
            self.issued[b] += 1
            yield item

    def _pull(self, branch: int) -> None:
        """Receives windows until one of `branch` arrives (others are kept for later)."""
        if self._results is None:
            # the first window of every branch is computed here, while the runner's workers
            # start: the first batch comes as fast as one window can be read
            for b in range(self.nb):
                t0 = time.perf_counter()
                self._receive(self.task((b, 0)), t0)
                self.issued[b] = 1
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
        """Assembles as many whole steps as the fetched windows hold (at least one) in one
        vectorised pass, into `self._ready`: per step its columns (views), refs and positions."""
        if not self._skip_applied:
            self._apply_skip()
        n, per = len(self.owned), self.plan.per_lane_at(self._asm_step)
        avail = sum((w.bounds[1:] - w.used for w in self.pending[0]), np.zeros(n, np.int64))
        steps = int(max(1, min(self._group, avail.min() // per if n else 1)))
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
                if self._ended[0][need > 0].any():
                    full = int((need0 - need).min() // per)  # steps every lane completed
                    if full == 0:
                        raise StopIteration
                    steps, need0 = full, full * per
                    break
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
        total = steps * n * per
        out: Columns = {}
        ref = np.empty((3, total), np.int64)
        for win, idx, dest in parts:
            keep = dest < total  # a finite plan's last, incomplete step is dropped
            idx, dest = idx[keep], dest[keep]
            for k, v in win.cols.items():
                if k not in out:
                    out[k] = np.empty((total,) + v.shape[1:], dtype=v.dtype)
                elif out[k].dtype != v.dtype and out[k].dtype != object and v.dtype == object:
                    out[k] = out[k].astype(object)
                out[k][dest] = v[idx]
            ref[0, dest], ref[1, dest], ref[2, dest] = win.refs.source[idx], win.refs.record[idx], win.refs.epoch[idx]
        expands = self.pipeline.expands
        rows = n * per
        for s in range(steps):
            last = (s + 1) * per - 1
            position = canonical(index_at[:, last], sub_at[:, last] + 1, expands)
            view = slice(s * rows, (s + 1) * rows)
            self._ready.append(({k: v[view] for k, v in out.items()},
                                Refs(ref[0, view], ref[1, view], ref[2, view]), position))
        self._asm_step += steps

    # --- the general path: per lane, through the mix schedule and the accumulator --------------
    def _peek(self, b: int, k: int, count: int) -> list[tuple[Window, int]]:
        """The next `count` unused rows of branch b for lane k (fewer if the lane ended)."""
        out: list[tuple[Window, int]] = []
        wi = 0
        while len(out) < count:
            if wi == len(self.pending[b]):
                if self._ended[b][k]:
                    break
                self._pull(b)
            win = self.pending[b][wi]
            win.raise_error()
            self._ended[b] |= win.ended
            lo, hi = int(win.used[k]), int(win.bounds[k + 1])
            out += [(win, r) for r in range(lo, min(hi, lo + count - len(out)))]
            wi += 1
        return out

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

    def _first_skip(self, k: int) -> None:
        """A restored lane drops the outputs of its first input it had used already."""
        st = self.states[k]
        for b in range(self.nb):
            if st.skip[b]:
                rows = self._peek(b, k, st.skip[b])
                drop = sum(1 for w, r in rows if w.index[r] == st.cursor[b] and w.sub[r] < st.skip[b])
                self._use(b, k, drop)

    def _candidates(self, k: int, count: int, mix: Sequence[int]
                    ) -> tuple[list[tuple[Window, int]], list[int]]:
        """The lane's next `count` inputs to the accumulator, following the mix schedule."""
        if self.schedule is None:
            rows = self._peek(0, k, count)
            return rows, [0] * len(rows)
        return self.schedule.candidates(lambda b, c: self._peek(b, k, c), count, mix, self.step)

    def _general_step(self) -> tuple[Columns, Any]:
        per = self.plan.per_lane_at(self.step)
        acc = self.pipeline.acc
        lane_outs: list[Columns] = []
        provenance: list[list[tuple[int, int, int, int, int]]] = []
        new_states: list[LaneState] = []
        for k in range(len(self.owned)):
            if not self._skip_applied:
                self._first_skip(k)
            st = self.states[k]
            cursor, skip, mix = list(st.cursor), list(st.skip), list(st.mix)
            if self.schedule is not None and self.schedule.restarts(self.step):
                mix = [0] * len(mix)
            held_cols, held_prov = self._held[k] if acc is not None else ({}, [])
            carry = st.carry
            got: list[Columns] = []
            prov: list[list[tuple[int, int, int, int, int]]] = []
            produced = 0
            guess = max(4, per * 4)
            while produced < per:
                rows, branches = self._candidates(k, guess, mix)
                new = _gather(rows)
                new_prov = [(b, int(w.index[r]), int(w.sub[r]), int(w.refs.source[r]),
                             int(w.refs.record[r]), int(w.refs.epoch[r])) for (w, r), b in zip(rows, branches)]
                demand = per - produced
                if acc is None:
                    used = min(demand, len(rows))
                    outs = take_rows(new, np.arange(used))
                    segs = [[(p[3], p[4], p[5], -1, -1)] for p in new_prov[:used]]  # whole rows
                    produced_now = used
                else:
                    queue = concat_cols([held_cols, new]) if held_cols else new
                    # fewer candidates than asked for: the lane's inputs end with these
                    call = acc.finish if len(rows) < guess else acc.step
                    res = call(carry, held_cols if held_cols else take_rows(new, np.arange(0)), new, demand)
                    used = int(res.consumed)
                    if not 0 <= used <= len(rows):
                        raise PlanError(f"{acc.op_name}.step consumed {used} of {len(rows)} new inputs")
                    outs = res.outputs
                    produced_now = len(next(iter(outs.values()))) if outs else 0
                    if produced_now > demand:
                        raise PlanError(f"{acc.op_name}.step emitted {produced_now} rows for a "
                                        f"demand of {demand}")
                    all_prov = held_prov + new_prov
                    hold = [int(h) for h in res.hold]
                    n_avail = len(held_prov) + used
                    if any(not 0 <= h < n_avail for h in hold):
                        raise PlanError(f"{acc.op_name}.step holds inputs {hold} outside the "
                                        f"{n_avail} it has seen")
                    held_cols = take_rows(queue, np.asarray(hold, np.int64)) if hold else {}
                    held_prov = [all_prov[h] for h in hold]
                    carry = res.carry
                    segs = [[(all_prov[i][3], all_prov[i][4], all_prov[i][5], s0, s1) for i, s0, s1 in row]
                            for row in (res.segments or [[] for _ in range(produced_now)])]
                taken = [0] * self.nb
                for (w, r), b in zip(rows[:used], branches[:used]):
                    cursor[b], skip[b] = int(w.index[r]), int(w.sub[r]) + 1
                    if self.schedule is not None:
                        mix[b] += self.schedule.count(w.cols, r)
                    taken[b] += 1
                for b, t in enumerate(taken):
                    if t:
                        self._use(b, k, t)
                if produced_now:
                    got.append(outs)
                    prov += segs
                produced += produced_now
                if produced < per:
                    if used == 0 and len(rows) < guess:
                        raise StopIteration  # the lane's inputs ended: a finite plan is over
                    guess *= 2
            if acc is not None:
                self._held[k] = (held_cols, held_prov)
            lane_outs.append(concat_cols(got))
            provenance += prov
            cur, skp = canonical(np.array(cursor, np.int64), np.array(skip, np.int64),
                                 self.pipeline.expands)
            new_states.append(LaneState(tuple(int(c) for c in cur), tuple(int(x) for x in skp),
                                        tuple(mix), tuple((p[0], p[1], p[2]) for p in held_prov),
                                        carry))
        self._skip_applied = True
        self._states = new_states
        self.step += 1
        if acc is None:  # whole records (a mix by tokens without packing): plain refs
            refs = np.array([row[0][:3] for row in provenance], np.int64).reshape(-1, 3)
            return concat_cols(lane_outs), Refs(refs[:, 0].copy(), refs[:, 1].copy(), refs[:, 2].copy())
        return concat_cols(lane_outs), provenance

    def next(self) -> tuple[Columns, Any]:
        if self.schedule is None and self.pipeline.acc is None:
            if not self._ready:
                self._simple_steps()
            cols, refs, self._simple = self._ready.popleft()
            return cols, refs
        return self._general_step()


def _gather(rows: list[tuple[Window, int]]) -> Columns:
    """Columns of (window, row) pairs, in order (one gather per window)."""
    if not rows:
        return {}
    parts: list[Columns] = []
    i = 0
    while i < len(rows):
        win = rows[i][0]
        j = i
        while j < len(rows) and rows[j][0] is win:
            j += 1
        parts.append(take_rows(win.cols, np.fromiter((r for _, r in rows[i:j]), np.int64, j - i)))
        i = j
    return concat_cols(parts)

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

The engine is three parts, each with its own state: the window stream (`WindowStream`: which
windows are issued, arrived, still in use), and one of two assemblies — lock-step
(`zephon.exec.lockstep`: no mix, no accumulator; every lane's rows of many steps in one
vectorised pass) or per lane (`zephon.exec.perlane`: the token-mix schedule and the
accumulator, lane by lane). Terms: docs/glossary.md.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import StateError
from zephon.exec.feed import LaneFeed
from zephon.exec.lockstep import DryGuard, LockstepAssembly
from zephon.exec.perlane import PerLaneAssembly
from zephon.exec.pipeline import LanePipeline
from zephon.exec.schedule import TokenSchedule
from zephon.exec.state import LaneState
from zephon.exec.steps import Sink
from zephon.exec.windows import LaneItem, Window, WindowTask, privatize, rematerialize, window_size
from zephon.plan import Batching, Mix
from zephon.sources.base import Columns, RecordSource

if TYPE_CHECKING:  # annotation only: importing zephon.runners here would load it with the core
    from zephon.runners.base import Runner

log = logging.getLogger(__name__)


#: Pending windows per branch whose columns may stay in a runner's shared memory (older ones are
#: copied out: see `WindowStream.use`).
_SHARED_WINDOWS = 3


@dataclass
class WindowSchedule:
    """Per source branch: the windows issued to the runner, those that arrived and still hold
    unused rows, and which lanes' inputs are known to end."""

    branches: int
    lanes: int
    #: the number of the next window to issue, per branch (= windows issued so far)
    issued: list[int] = field(init=False)
    #: windows each branch is expected to need next (one more each time it waits for one): the
    #: branch whose issued windows are fewest relative to it gets the next window
    expected: list[float] = field(init=False)
    #: windows that arrived and still hold unused rows, per branch, in window order
    pending: list[deque[Window]] = field(init=False)
    #: `(branch, window)` of pending windows already copied out of the runner's shared memory
    copied: set[tuple[int, int]] = field(init=False)
    #: per branch, the lanes whose inputs end within the windows that arrived
    ended: list[np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.issued = [0] * self.branches
        self.expected = [0.0] * self.branches
        self.pending = [deque() for _ in range(self.branches)]
        self.copied = set()
        self.ended = [np.zeros(self.lanes, bool) for _ in range(self.branches)]


class WindowStream:
    """The windows of a lane engine's owned lanes: issued ahead to the runner (the first of
    each branch inline), received in order, and used row by row by the assembly — the parallel
    half's interface to the sequential one."""

    def __init__(self, task: WindowTask, feed: LaneFeed | None, runner: Runner | None, branches: int) -> None:
        #: `(branch, w)` or a `LaneItem` -> `Window` (pure, picklable: what the runner maps)
        self.task = task
        #: the general path reads each lane from its own frontier (bounded memory under drift);
        #: the lock-step path takes every lane's rows together, so its windows read all lanes
        self.feed = feed
        self.runner = runner
        self.schedule = WindowSchedule(branches, len(task.owned))
        #: the runner's results, in issue order (None before the first pull)
        self.results: Iterator[Window] | None = None
        #: telemetry: hears of each window and how long the consumer waited for it
        self.sink: Sink | None = None

    @property
    def branches(self) -> int:
        return self.schedule.branches

    @property
    def pending(self) -> list[deque[Window]]:
        """Arrived windows with unused rows, per branch (`WindowSchedule.pending`)."""
        return self.schedule.pending

    @property
    def ended(self) -> list[np.ndarray]:
        """Per branch, the lanes whose inputs end within the arrived windows."""
        return self.schedule.ended

    def _items(self) -> Iterator[tuple[int, int] | LaneItem]:
        sched = self.schedule
        while True:
            if sched.branches == 1:
                b = 0
            else:  # the branch whose look-ahead is smallest relative to what it is used at
                b = min(range(sched.branches), key=lambda i: (sched.issued[i] - sched.expected[i], i))
            yield self._item(b)

    def _item(self, b: int) -> tuple[int, int] | LaneItem:
        w = self.schedule.issued[b]
        self.schedule.issued[b] += 1
        if self.feed is None:
            return b, w
        unused = sum((win.bounds[1:] - win.used for win in self.pending[b]),
                     np.zeros(self.schedule.lanes, np.int64))
        return self.feed.item(b, w, unused)

    def pull(self, branch: int) -> None:
        """Receives windows until one of `branch` arrives (others are kept for later)."""
        if self.results is None:
            # the first window of every branch is computed here, while the runner's workers
            # start: the first batch comes as fast as one window can be read
            for b in range(self.branches):
                t0 = time.perf_counter()
                self._receive(self.task(self._item(b)), t0)
            items = self._items()
            self.results = (map(self.task, items) if self.runner is None
                            else iter(self.runner.imap(self.task, items)))
            return
        while True:
            self.schedule.expected[branch] += 1
            t0 = time.perf_counter()
            win = next(self.results)
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

    def peek(self, b: int, k: int, count: int) -> list[tuple[Window, int]]:
        """The next `count` unused rows of branch b for lane k (fewer if the lane ended)."""
        return self.arrived(b, k, count, count)[0]

    def arrived(self, b: int, k: int, least: int, most: int) -> tuple[list[tuple[Window, int]], bool]:
        """Lane k's next unused rows of branch b in windows that have arrived, up to `most`;
        windows are pulled only while there are fewer than `least`. Also whether the lane's
        inputs end with these rows."""
        out: list[tuple[Window, int]] = []
        wi = 0
        while len(out) < most:
            if wi == len(self.pending[b]):
                if self.ended[b][k]:
                    return out, True
                if len(out) >= least:
                    break
                if self.feed is not None:
                    self.feed.ask(b, k)
                self.pull(b)
            win = self.pending[b][wi]
            win.raise_error()
            self.ended[b] |= win.ended
            lo, hi = int(win.used[k]), int(win.bounds[k + 1])
            out += [(win, r) for r in range(lo, min(hi, lo + most - len(out)))]
            wi += 1
        return out, False

    def use(self, b: int, k: int, count: int) -> None:
        """Marks lane k's next `count` rows of branch b used; drops windows used up."""
        for win in self.pending[b]:
            if not count:
                break
            t = min(count, int(win.bounds[k + 1] - win.used[k]))
            win.used[k] += t
            count -= t
        pending, copied = self.pending[b], self.schedule.copied
        while pending and np.all(pending[0].used >= pending[0].bounds[1:]):
            copied.discard((b, pending.popleft().number))
        # Lanes drift apart in a branch (a token mix, filters), so old windows stay pending for
        # the slowest lanes. A window's columns may be views of a runner's shared memory, which
        # cannot be reused while they live: past the newest few, windows are copied once, so the
        # shared memory in use stays bounded however far the lanes drift.
        for i in range(len(pending) - _SHARED_WINDOWS):
            win = pending[i]
            if (b, win.number) not in copied:
                privatize(win)
                copied.add((b, win.number))

    def drop_used(self, b: int) -> None:
        """Drops the windows of branch b whose rows every lane used."""
        pending = self.pending[b]
        while pending and np.all(pending[0].used >= pending[0].bounds[1:]):
            pending.popleft()

    def close(self) -> None:
        results, self.results = self.results, None
        closer = getattr(results, "close", None)
        if closer is not None:
            closer()


@dataclass(frozen=True, eq=False)
class LaneRun:
    """What runs in a loader's lanes — plan, record sources, lane pipeline, owned lanes, seed,
    read-ahead — everything a `LaneEngine` needs except where the lanes stand. A loader's lane
    core runs one engine from it; counting a finite plan's end (`zephon.exec.end`) runs more."""

    plan: Batching
    sources: Mapping[int, RecordSource]
    stages: LanePipeline
    owned: np.ndarray
    seed: int
    read_ahead: int
    branches: int  # source branches: a token mix reads each of its sources' lane streams apart

    @property
    def token_mix(self) -> bool:
        """Whether lanes follow a mix by tokens (its counters are part of a lane's state)."""
        return self.branches > 1

    def start_states(self, lanes: np.ndarray | None = None) -> list[LaneState]:
        """Every lane (of `lanes`, default the owned ones) at its first input."""
        return [LaneState.start(self.branches, 0, self.token_mix)
                for _ in (self.owned if lanes is None else lanes)]

    def engine(self, lanes: np.ndarray, states: Sequence[LaneState], step: int, epoch: int,
               runner: Runner | None = None, read_ahead: int | None = None) -> LaneEngine:
        """A `LaneEngine` of `lanes` from `states` at `step` of pass `epoch`."""
        return LaneEngine(self.plan, self.sources, self.stages, lanes, self.seed, runner,
                          self.read_ahead if read_ahead is None else read_ahead, states, step, epoch)


# --- the engine: the sequential part -------------------------------------------------------------
class LaneEngine:
    """Produces the owned rows of consecutive steps of a count-changing pipeline.

    `states` are the owned lanes' `LaneState`s at the first step, `step` (needed by a weight
    schedule), `epoch` the pass over a finite plan; `next()` returns the next step's columns
    (lane-major), the provenance of its rows and their validity, and updates `states`. A lane
    whose inputs ran out pads its rows (invalid) until every owned lane ran out.
    """

    def __init__(self, plan: Batching, sources: Mapping[int, RecordSource], pipeline: LanePipeline,
                 owned: np.ndarray, seed: int, runner: Runner | None, read_ahead: int,
                 states: Sequence[LaneState], step: int = 0, epoch: int = 0) -> None:
        self.plan, self.pipeline, self.owned = plan, pipeline, owned
        lanes = plan.lanes
        branches = len(lanes.branches)
        mix = lanes.child if isinstance(lanes.child, Mix) and lanes.child.sequential else None
        schedule = None if mix is None else TokenSchedule.of(mix)
        start = list(states)
        largest = plan.sizes.largest // lanes.count  # a batch-size ramp's largest share of a lane
        starts = tuple(np.array([s.cursor[b] for s in start], np.int64) for b in range(branches))
        size = window_size(read_ahead, len(owned), largest)
        first = plan.per_lane_at(step)
        lockstep = schedule is None and pipeline.acc is None
        if not lockstep:
            # documents (tokenize, pack): ~128 inputs a window keep encode_batch efficient and
            # spread across processes' windows, while several windows are in flight on the runner
            size = max(8, min(size, 128 // max(1, len(owned))))
            first = 2
        #: per branch, each owned lane's number of inputs (None: the branch never ends)
        limits = tuple(lanes.lane_limits(owned, b, plan.pad) for b in range(branches))
        task = WindowTask(lanes, sources, pipeline.rows, owned, seed, starts, size, first, limits, epoch)
        #: the windows: issued, arrived, in use
        self.windows = WindowStream(task, None if lockstep else LaneFeed(starts, limits, first, size),
                                    runner, branches)
        #: the assembly of steps from the windows: lock-step, or lane by lane
        self.assembly: LockstepAssembly | PerLaneAssembly
        if lockstep:
            period = lanes.child.period if branches == 1 else None
            self.assembly = LockstepAssembly(
                plan, pipeline, owned, self.windows, limits[0], start, step,
                # steps assembled in one pass: bounded like a group read
                group=max(1, min(64, read_ahead // max(1, len(owned) * largest))),
                dry=DryGuard.of(None if period is None else -(-period // lanes.count), len(owned)))
            return
        held: list[tuple[Columns, list[Any]]] = []
        if pipeline.acc is not None:
            held = rematerialize(task, start)
            for lane, st, (cols, _) in zip(owned, start, held):
                try:
                    pipeline.acc.check_carry(st.carry, cols)
                except (ValueError, TypeError, KeyError) as e:
                    raise StateError(f"lane {int(lane)} of the state has a 'carry' that "
                                     f"{pipeline.acc.op_name} cannot continue from: {e}. The state "
                                     "was edited or belongs to another pipeline.") from None
        self.assembly = PerLaneAssembly(plan, pipeline, schedule, owned, self.windows, start, step, held)

    @property
    def states(self) -> list[LaneState]:
        """The owned lanes' states after the last step."""
        return self.assembly.states

    @property
    def sink(self) -> Sink | None:
        """Telemetry's hook for windows (set by the loader when telemetry is on)."""
        return self.windows.sink

    @sink.setter
    def sink(self, sink: Sink | None) -> None:
        self.windows.sink = sink

    def close(self) -> None:
        self.windows.close()

    def next(self) -> tuple[Columns, Any, np.ndarray]:
        """The next step's owned rows (lane-major), their provenance (refs, or per packed row
        its segments) and validity (False: padding of a lane that ran out). StopIteration once
        every owned lane ran out."""
        return self.assembly.next()

    def mark(self) -> tuple[Any, ...]:
        """The engine's position now, for `states_at` (cheap: references, no copies)."""
        return self.assembly.mark()

    @staticmethod
    def states_at(mark: tuple[Any, ...]) -> list[LaneState]:
        """The lanes' states at a `mark()`."""
        states, simple = mark
        if simple is None:
            return list(states)
        return [LaneState((int(c),), (int(k),)) for c, k in zip(*simple)]

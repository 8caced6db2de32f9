"""The lane engine's lock-step assembly: no mix, no accumulator — every lane's rows at once.

Without a token mix or an accumulator, a lane's next `B/L` outputs are simply its next unused
window rows (a filter or flat map changes how many inputs that takes, nothing else). So every
owned lane's rows of as many steps as the arrived windows hold are gathered in one vectorised
pass, and a lane's position after a step is just the last input it used and how many of that
input's outputs (`canonical`). A lane whose inputs ran out fills its rows with padding rows
(`zephon.exec.padding`), marked invalid; the stream ends only when every lane ran out. The
general case, lane by lane, is `zephon.exec.perlane`; the windows are `zephon.exec.lanes`'.
Terms: docs/glossary.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.padding import fill_blanks
from zephon.exec.pipeline import LanePipeline
from zephon.exec.state import LaneState, canonical
from zephon.exec.windows import Window
from zephon.plan import Batching, Refs
from zephon.sources.base import Columns

if TYPE_CHECKING:  # annotation only: the stream is the engine's (zephon.exec.lanes imports this)
    from zephon.exec.lanes import WindowStream

#: One assembled step: its columns (views), refs, every lane's position after it, validity.
ReadyStep = tuple[Columns, Refs, tuple[np.ndarray, np.ndarray], np.ndarray]


@dataclass
class DryGuard:
    """The never-outputs guard: a lane that read 64 epochs of its inputs (at least 65,536)
    without one output is refused (its filter rejects everything; waiting would hang)."""

    #: inputs of one epoch of a lane (None: the plan has no epochs, and no guard)
    epoch_inputs: int | None
    #: inputs a lane may read without an output
    limit: int
    #: per lane, inputs read since its last output
    dry: np.ndarray
    #: the last window number counted (windows come in order)
    checked: int = -1

    @staticmethod
    def of(epoch_inputs: int | None, lanes: int) -> DryGuard:
        limit = 0 if epoch_inputs is None else max(64 * epoch_inputs, 1 << 16)
        return DryGuard(epoch_inputs, limit, np.zeros(lanes, np.int64))


@dataclass
class LockstepCursor:
    """Where the lock-step assembly stands."""

    #: the step assembled next (steps ahead of the consumer wait in `ready`)
    step: int
    #: every lane's (cursor, skip) after the last step handed out (None: `states` is current)
    positions: tuple[np.ndarray, np.ndarray] | None
    #: assembled steps not handed out yet
    ready: deque[ReadyStep]
    #: steps assembled in one pass at most (bounded like a group read)
    group: int


class LockstepAssembly:
    """Assembles steps of every owned lane together from `windows` (see the module doc)."""

    def __init__(self, plan: Batching, pipeline: LanePipeline, owned: np.ndarray, windows: WindowStream,
                 limit: np.ndarray | None, states: list[LaneState], step: int, group: int, dry: DryGuard) -> None:
        self.plan, self.pipeline, self.owned = plan, pipeline, owned
        self.windows = windows
        #: each owned lane's number of inputs (None: they never end): where a lane that ran out stands
        self.limit = limit
        self._states = states
        self.cursor = LockstepCursor(step, None, deque(), group)
        self.dry = dry
        #: restored lanes' already-used outputs of their first input were dropped
        self.skip_applied = False

    @property
    def states(self) -> list[LaneState]:
        """The owned lanes' states after the last step (built on demand: a step only updates
        arrays)."""
        if self.cursor.positions is not None:
            cur, skip = self.cursor.positions
            self._states = [LaneState((int(c),), (int(k),)) for c, k in zip(cur, skip)]
            self.cursor.positions = None
        return self._states

    def mark(self) -> tuple[Any, ...]:
        """The position now, for `LaneEngine.states_at` (cheap: references, no copies)."""
        return (self._states, self.cursor.positions)

    def next(self) -> tuple[Columns, Any, np.ndarray]:
        if not self.cursor.ready:
            self._assemble()
        cols, refs, self.cursor.positions, valid = self.cursor.ready.popleft()
        return cols, refs, valid

    def _apply_skip(self) -> None:
        """Drops outputs a restored lane had already used of its first input (flat maps)."""
        self.skip_applied = True
        skip = np.array([s.skip[0] for s in self.states], np.int64)
        if not skip.any():
            return
        pending = self.windows.pending[0]
        if not pending:
            self.windows.pull(0)
        win = pending[0]  # a lane's first input lies in the first window
        win.raise_error()
        for k in np.flatnonzero(skip):
            rows = np.arange(win.used[k], win.bounds[k + 1])
            first = rows[(win.index[rows] == self.states[k].cursor[0]) & (win.sub[rows] < skip[k])]
            win.used[k] += len(first)

    def _check_dry(self, win: Window, got: np.ndarray, wanted: np.ndarray) -> None:
        """Raises when a lane read 64 epochs of its inputs (at least 65,536) without one output:
        its filter rejects everything it sees, and waiting would hang the training loop."""
        guard = self.dry
        if guard.epoch_inputs is None:
            return
        if win.number <= guard.checked:
            return
        guard.checked = win.number
        span = self.windows.task.span(win.number)[1]
        guard.dry = np.where(got | ~wanted, 0, guard.dry + span)
        bad = np.flatnonzero(guard.dry > guard.limit)
        if bad.size:
            lane = int(self.owned[bad[0]])
            why = ", ".join(t.op_name for t in self.pipeline.rows if not t.one_to_one) or "the pipeline"
            raise PlanError(f"lane {lane} read {int(guard.dry[bad[0]])} inputs (an epoch of it holds "
                            f"{guard.epoch_inputs}) without one record passing {why}: it will "
                            "not fill a batch. Check the filter, or deal the data into lanes "
                            "differently (lanes(L) deals positions l, l+L, ...; shuffle before lanes()).")

    def _assemble(self) -> None:
        """Assembles as many steps as the fetched windows hold (at least one) in one vectorised
        pass, into `cursor.ready`: per step its columns (views), refs, positions and validity.
        A lane that ran out fills its rows with padding; StopIteration once every lane ran out."""
        if not self.skip_applied:
            self._apply_skip()
        cursor, windows = self.cursor, self.windows
        pending, ended = windows.pending[0], windows.ended
        n, per = len(self.owned), self.plan.per_lane_at(cursor.step)
        avail = sum((w.bounds[1:] - w.used for w in pending), np.zeros(n, np.int64))
        live = avail[~ended[0]]
        ahead = live.min() // per if live.size else -(-int(avail.max(initial=0)) // per)
        steps = int(max(1, min(cursor.group, ahead)))
        end = self.plan.sizes.stretch_end(cursor.step)  # one pass assembles steps of one size
        if end is not None:
            steps = min(steps, end - cursor.step)
        need0 = steps * per
        need = np.full(n, need0, np.int64)
        parts: list[tuple[Window, np.ndarray, np.ndarray]] = []
        index_at = np.empty((n, need0), np.int64)
        sub_at = np.empty((n, need0), np.int64)
        wi = 0
        while need.any():
            if wi == len(pending):
                if ended[0][need > 0].all():
                    break  # the lanes still short ran out: the rest of their rows are padding
                windows.pull(0)
            win = pending[wi]
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
            ended[0] |= win.ended
            if need.any():
                wi += 1
        windows.drop_used(0)
        got = need0 - need
        if not got.any():
            raise StopIteration  # every lane ran out
        steps = -(-int(got.max()) // per)  # steps with at least one valid row
        need0 = steps * per
        valid = np.arange(need0)[None, :] < got[:, None]  # (lane, output)
        short = np.flatnonzero(got < need0)
        if short.size:  # a lane that ran out is at its end: (inputs, 0)
            limit = self.limit
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
            cursor.ready.append(({k: v[view] for k, v in out.items()},
                                 Refs(ref[0, view], ref[1, view], ref[2, view]), position, flat_valid[view]))
        cursor.step += steps


__all__ = ["DryGuard", "LockstepAssembly", "LockstepCursor"]

"""The lane engine's general path: each lane in turn, through the mix schedule and an accumulator.

Pipelines with a token mix (or a mix read whole, `Mix(stop="all")`) or an accumulator (packing)
assemble a step lane by lane: a lane's next inputs follow the mix schedule, go through the
accumulator, and its `B/L` outputs are the lane's rows of the step. A lane whose inputs ran out
(and whose accumulator has emitted what it held) fills the rest of its rows with padding rows
(`zephon.exec.padding`), marked invalid; the step ends the stream only when every lane ran out.
The window plumbing (`WindowStream.peek`, `use`, `arrived`) lives in `zephon.exec.lanes`, the
lock-step case (no mix, no accumulator) in `zephon.exec.lockstep`. Terms: docs/glossary.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.padding import blank_rows, schema_of
from zephon.exec.pipeline import LanePipeline
from zephon.exec.schedule import TokenSchedule
from zephon.exec.state import LaneState, canonical
from zephon.exec.windows import Provenance, Window, concat_cols, take_rows
from zephon.plan import Batching, Refs
from zephon.sources.base import Columns

if TYPE_CHECKING:  # annotation only: the stream is the engine's (zephon.exec.lanes imports this)
    from zephon.exec.lanes import WindowStream

Segment = tuple[int, int, int, int, int]  # (source, record, epoch, token start, token stop)


class PerLaneAssembly:
    """Assembles each step lane by lane from `windows`, through the mix schedule and the
    accumulator (see the module doc).

    Args:
      schedule: the token-mix schedule (None: no mix by tokens).
      states: the owned lanes' states at `step`.
      held: per owned lane, the inputs the accumulator holds (columns and provenance), re-read
        from the states (`rematerialize`); empty without an accumulator.
    """

    def __init__(self, plan: Batching, pipeline: LanePipeline, schedule: TokenSchedule | None, owned: np.ndarray,
                 windows: WindowStream, states: list[LaneState], step: int,
                 held: list[tuple[Columns, list[Provenance]]]) -> None:
        self.plan, self.pipeline, self.schedule, self.owned = plan, pipeline, schedule, owned
        self.windows = windows
        self.branches = windows.branches
        #: the owned lanes' states after the last step
        self.states = states
        #: the step assembled next
        self.step = step
        #: per owned lane, the inputs the accumulator holds: their columns and provenance
        self.held = held
        #: restored lanes' already-used outputs of their first input were dropped
        self.skip_applied = False

    def mark(self) -> tuple[Any, ...]:
        """The position now, for `LaneEngine.states_at`."""
        return (self.states, None)

    def _first_skip(self, k: int) -> None:
        """A restored lane drops the outputs of its first input it had used already."""
        st = self.states[k]
        for b in range(self.branches):
            if st.skip[b]:
                rows = self.windows.peek(b, k, st.skip[b])
                drop = sum(1 for w, r in rows if w.index[r] == st.cursor[b] and w.sub[r] < st.skip[b])
                self.windows.use(b, k, drop)

    def _candidates(self, k: int, count: int, mix: Sequence[int]
                    ) -> tuple[list[tuple[Window, int]], list[int]]:
        """The lane's next `count` inputs to the accumulator, following the mix schedule."""
        if self.schedule is None:
            rows = self.windows.peek(0, k, count)
            return rows, [0] * len(rows)
        return self.schedule.candidates(lambda b, c: self.windows.peek(b, k, c), count, mix, self.step)

    def _lane(self, k: int) -> tuple[Columns, int, list[list[Segment]], LaneState]:
        """Lane k's outputs of the step (up to `per`; fewer when its inputs ran out), their
        provenance and the lane's state after them."""
        per = self.plan.per_lane_at(self.step)
        acc = self.pipeline.acc
        if not self.skip_applied:
            self._first_skip(k)
        st = self.states[k]
        cursor, skip, mix = list(st.cursor), list(st.skip), list(st.mix)
        if self.schedule is not None and self.schedule.restarts(self.step):
            mix = [0] * len(mix)
        held_cols, held_prov = self.held[k] if acc is not None else ({}, [])
        carry = st.carry
        got: list[Columns] = []
        prov: list[list[Segment]] = []
        produced = 0
        guess = max(4, per * 4)
        # a streaming accumulator takes the rows that have arrived (at least `least`, pulling
        # windows only for those): the first batch needs the first windows, not `guess` rows
        streams = acc is not None and acc.streams and self.schedule is None
        least = 1
        while produced < per:
            if streams:
                rows, ended = self.windows.arrived(0, k, least, max(guess, least))
                branches = [0] * len(rows)
            else:
                rows, branches = self._candidates(k, guess, mix)
                ended = len(rows) < guess  # fewer candidates than asked for: the inputs end here
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
                call = acc.finish if ended else acc.step
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
            taken = [0] * self.branches
            for (w, r), b in zip(rows[:used], branches[:used]):
                cursor[b], skip[b] = int(w.index[r]), int(w.sub[r]) + 1
                if self.schedule is not None:
                    mix[b] += self.schedule.count(w.cols, r)
                taken[b] += 1
            for b, t in enumerate(taken):
                if t:
                    self.windows.use(b, k, t)
            if produced_now:
                got.append(outs)
                prov += segs
            produced += produced_now
            if produced < per:
                if used == 0 and ended:
                    break  # the lane's inputs ended: the rest of its rows are padding
                if streams:  # next time, at least one input it has not been offered yet
                    least = len(rows) - used + 1
                else:
                    guess *= 2
        if acc is not None:
            self.held[k] = (held_cols, held_prov)
        cur, skp = canonical(np.array(cursor, np.int64), np.array(skip, np.int64), self.pipeline.expands)
        state = LaneState(tuple(int(c) for c in cur), tuple(int(x) for x in skp), tuple(mix),
                          tuple((p[0], p[1], p[2]) for p in held_prov), carry)
        return concat_cols(got), produced, prov, state

    def next(self) -> tuple[Columns, Any, np.ndarray]:
        """The owned rows of the next step, their provenance and validity; StopIteration when
        every owned lane ran out (nothing valid is left)."""
        per = self.plan.per_lane_at(self.step)
        held_before = list(self.held)
        lanes = [self._lane(k) for k in range(len(self.owned))]
        if not any(n for _, n, _, _ in lanes):
            self.held = held_before
            raise StopIteration
        schema = next(schema_of(c) for c, n, _, _ in lanes if n)
        assert schema is not None
        parts: list[Columns] = []
        provenance: list[list[Segment]] = []
        valid = np.zeros(len(self.owned) * per, bool)
        for k, (cols, n, prov, _) in enumerate(lanes):
            parts.append(cols if n == per else concat_cols([cols, blank_rows(schema, per - n)]))
            provenance += prov + [[] for _ in range(per - n)]
            valid[k * per:k * per + n] = True
        self.skip_applied = True
        self.states = [st for _, _, _, st in lanes]
        self.step += 1
        if self.pipeline.acc is None:  # whole records (a mix without packing): plain refs
            refs = np.array([row[0][:3] if row else (-1, -1, -1) for row in provenance], np.int64).reshape(-1, 3)
            return concat_cols(parts), Refs(refs[:, 0].copy(), refs[:, 1].copy(), refs[:, 2].copy()), valid
        return concat_cols(parts), provenance, valid


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

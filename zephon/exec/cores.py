"""The two cores an `Engine` holds one of: random access, or the lane engine.

Which rows a step holds is the same function of the plan either way; what differs is how a lane's
position is known. When every operator keeps one output per input, lane `l` stands at input
`step × B/L` after any step, so the random-access core computes any step directly (`StepTask`:
O(1) seek, `batch(k)`, `strided()`). Otherwise a lane's position depends on the data before it,
and the lane core runs the lanes in order (`LaneEngine`) from their saved states, up to the plan's
end (`End`). The engine picks one when it starts and talks to it through the same few verbs —
`next_rows`, `lanes_json`, `stop`, `restart` — so the rest of the loader does not branch on it.
Terms: docs/glossary.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from zephon.exec.end import End
from zephon.exec.lanes import LaneEngine, LaneRun
from zephon.exec.padding import schema_of
from zephon.exec.state import LaneState
from zephon.exec.steps import Sink, StepTask, iterate_steps
from zephon.exec.windows import take_rows
from zephon.plan import Refs
from zephon.sources.base import Columns

if TYPE_CHECKING:  # annotation only: importing zephon.runners here would load it with the core
    from zephon.runners.base import Runner

#: One step's owned rows (lane-major), their provenance (`Refs`, or per packed row its segments)
#: and which rows are valid (None: all of them).
Rows = tuple[Columns, Any, "np.ndarray | None"]


class Core(Protocol):
    """What an `Engine` asks of its core."""

    def next_rows(self, step: int, epoch: int, sink: Sink | None) -> Rows:
        """Rows of `step` (the step after the last one, unless the core was stopped);
        StopIteration at the plan's end."""
        ...

    def lanes_json(self, step: int, shift: int) -> dict[str, Any]:
        """The owned lanes' positions after the last step: `{lane: LaneState JSON}`."""
        ...

    def stop(self) -> None:
        """Stops work in flight; the next `next_rows` starts afresh where the lanes stand."""
        ...

    def restart(self, epoch: int) -> None:
        """Puts every owned lane at the start of pass `epoch` (call `stop` first)."""
        ...


class RandomAccessCore:
    """Steps of a one-to-one pipeline, computed directly: group reads on the runner, ahead."""

    def __init__(self, task: StepTask, runner: Runner | None, read_ahead: int) -> None:
        #: step -> owned rows (picklable; its `epoch` and `shift` follow the engine's)
        self.task = task
        self.runner = runner
        self.read_ahead = read_ahead
        #: the running group reads from the step after the last one (None: none running)
        self.pending: Iterator[tuple[Columns, Refs]] | None = None

    def next_rows(self, step: int, epoch: int, sink: Sink | None) -> Rows:
        if self.pending is None:
            self.pending = iterate_steps(self.task, self.runner, step, self.read_ahead, sink=sink)
        try:
            cols, refs = next(self.pending)
        except BaseException:
            self.stop()  # the next call starts afresh at the same step
            raise
        return cols, refs, None

    def rows(self, step: int) -> tuple[Columns, Refs]:
        """Any step's rows, read now (random access; nothing in flight changes)."""
        return self.task(step)

    def strided(self, start: int, stride: int, sink: Sink | None) -> Iterator[tuple[Columns, Refs]]:
        """Rows of steps start, start+stride, ... in group reads."""
        return iterate_steps(self.task, self.runner, start, self.read_ahead, stride, sink=sink)

    def lanes_json(self, step: int, shift: int) -> dict[str, Any]:
        at = self.task.plan.lane_offset(step) + shift
        return {str(int(l)): LaneState.start(1, at).to_json() for l in self.task.lanes}

    def stop(self) -> None:
        pending, self.pending = self.pending, None
        closer = getattr(pending, "close", None)
        if closer is not None:
            closer()

    def restart(self, epoch: int) -> None:
        self.move(epoch, self.task.shift)

    def move(self, epoch: int, shift: int) -> None:
        """Follows the engine to pass `epoch` and lane shift `shift`."""
        if (epoch, shift) != (self.task.epoch, self.task.shift):
            self.task = dataclasses.replace(self.task, epoch=epoch, shift=shift)


class LaneCore:
    """Steps of a count-changing pipeline: the lane engine, run from the owned lanes' states,
    padded where lanes ran out and stopped at the plan's end (`end`)."""

    def __init__(self, run: LaneRun, runner: Runner | None, end: End) -> None:
        self.run = run
        self.runner = runner
        self.end = end
        #: the owned lanes' states while no engine runs (the running engine's start otherwise)
        self.states: list[LaneState] = run.start_states()
        #: the engine running from `states` (None: none running; the next step starts one)
        self.engine: LaneEngine | None = None

    def current_states(self) -> list[LaneState]:
        """The owned lanes' states after the last step."""
        return self.engine.states if self.engine is not None else self.states

    def next_rows(self, step: int, epoch: int, sink: Sink | None) -> Rows:
        """The lanes' rows of `step`, padded where a lane ran out, or only padding once all owned
        lanes ran out and other ranks' lanes have not."""
        end_ = self.end
        end = self.end_step(step, epoch) if end_.agrees(epoch) else end_.ends.get(epoch)
        if end_.done or (end is not None and step >= end):
            raise StopIteration
        if end_.exhausted:
            return end_.blank(step, epoch)
        if self.engine is None:
            self.engine = self.run.engine(self.run.owned, self.states, step, epoch, self.runner)
            self.engine.sink = sink
        engine = self.engine
        mark = engine.mark() if end is None and not self.run.plan.pad else None
        try:
            cols, prov, valid = engine.next()
        except StopIteration:
            self.stop()
            end_.exhausted = True
            if end is None:  # every lane of the plan ran out here: the plan ends
                end_.done = True
                raise
            return end_.blank(step, epoch)
        except BaseException:
            self.stop()  # state stays after the last yielded batch
            raise
        if not self.run.plan.pad and not valid.all():
            # dropping, the first step a lane cannot fill is past the end: back to before it
            if end is None:  # not counted ahead: what is left is counted now (the rest only)
                end_.count_rest(engine, cols, valid, step, epoch)
            self.stop()
            if mark is not None:
                self.states = LaneEngine.states_at(mark)
            end_.done = True
            raise StopIteration
        if end_.schema is None:
            end_.schema = schema_of(take_rows(cols, valid.nonzero()[0]))
        if mark is not None:  # dropping, end not counted: what was emitted, for the share lost
            end_.seen_rows(cols, valid)
        return cols, prov, valid

    def end_step(self, step: int, epoch: int) -> int | None:
        """The plan's end in `epoch`, counted from where the lanes stand the first time."""
        return self.end.count(step, epoch, self.current_states())

    def lanes_json(self, step: int, shift: int) -> dict[str, Any]:
        acc = self.run.stages.acc is not None
        return {str(int(l)): s.to_json(acc) for l, s in zip(self.run.owned, self.current_states())}

    def stop(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            self.states = engine.states
            engine.close()

    def restart(self, epoch: int) -> None:
        self.states = self.run.start_states()

__all__ = ["Core", "LaneCore", "RandomAccessCore", "Rows"]

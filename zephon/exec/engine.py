"""The engine: a validated run and the one core that produces its rows, with its end and resume.

A `Loader` and every emitter built on it (JAX, torch, Grain) ask the same questions — the next
step's rows, where the lanes stand, go to this position, where the plan ends — and the answers
depend on the run only: the plan (completed: block sizes resolved, `remainder="auto"` decided),
the record sources, the lane pipeline, the owned lanes, the seed and the epoch. The engine checks
all of that once and holds it, and holds by composition exactly one of two cores
(`zephon.exec.cores`), chosen when it starts:

- `RandomAccessCore` when every operator keeps one output per input: lane positions are
  `step × B/L`, any step is computed directly, a seek is O(1);
- `LaneCore` otherwise: the lane engine runs the lanes in order from their saved states, and
  its `End` (`zephon.exec.end`) knows where a finite plan ends on every rank.

`Resume` (`zephon.exec.resume`) checks a state or position before anything moves; the engine
applies what it parsed. Turning rows into batches, and telemetry, are the `Loader`'s.
Terms: docs/glossary.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from zephon.checkpoint import STATE_VERSION
from zephon.errors import PlanError, StateError, check_positive_int
from zephon.exec.cores import LaneCore, RandomAccessCore, Rows
from zephon.exec.end import AllGather, End, Unemitted, lanes_finite
from zephon.exec.lanes import LaneEngine, LaneRun
from zephon.exec.pipeline import LanePipeline
from zephon.exec.resize import check_micro_schedule
from zephon.exec.resume import Resume
from zephon.exec.steps import READ_AHEAD_ROWS, Sink, StepTask
from zephon.pipeline import How, Pipeline, Where
from zephon.plan import Batching, Mix, Refs
from zephon.plan.blockshuffle import follow_blocks, resolve_blocks
from zephon.plan.walk import leaf_sources, plan_nodes
from zephon.sources.base import Columns, RecordSource

T = TypeVar("T")


class Engine:
    """One run of a pipeline in this process's lanes: checked once, then stepped, positioned
    and resumed. See the module doc; `zephon.Loader` is the numpy layer over it.

    Args:
      pipeline, where, how: the run (see `zephon.Pipeline`, `zephon.Where`, `zephon.How`);
        `how.telemetry` and `how.domains` are the emitter's, not read here.
      start_step: first global batch (random-access pipelines; others restore a state).
      epoch: the pass over a finite plan.
      end: the plan's end step in `epoch` if known already (no counting).
    """

    def __init__(self, pipeline: Pipeline, where: Where, how: How, *, start_step: int = 0, epoch: int = 0,
                 end: int | None = None) -> None:
        plan, sources, transforms = pipeline.plan, pipeline.sources, pipeline.ops
        per_source, seed = pipeline.per_source, pipeline.seed
        rank, world = where.rank_world()
        lanes, all_gather = where.lanes, where.all_gather
        runner, read_ahead, micro_batches = how.runner, how.read_ahead, how.micro_batches
        #: `{Source id: record source}` (the pipeline holds them keyed so already)
        self.sources: dict[int, RecordSource] = dict(sources)
        plan = resolve_blocks(plan, self.sources)  # block_shuffle(block="auto"): the sources' unit
        _check_sources(plan, self.sources)
        #: how many source ids the plan reads (ids 0..n-1; per-domain accounting)
        self.n_sources = max((s.id for s in leaf_sources(plan)), default=0) + 1
        #: the lane pipeline: per-source and row operators, the accumulator, one-to-one operators after it
        self.stages = LanePipeline.split(transforms, per_source)
        if getattr(runner, "pickles", False):  # processes(): say so now, not at some later batch
            _check_picklable(self.stages.ops)
        # seed, rank and world were checked by Pipeline and Where; the epoch is the engine's own
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise PlanError(f"Loader(epoch=...) must be a non-negative integer, got {epoch!r}")
        self.seed = seed
        self.rank, self.world = rank, world
        #: the lanes this engine produces, in lane order
        self.owned: np.ndarray = plan.lanes.owned(self.rank, self.world)
        if micro_batches is not None:
            check_micro_schedule(plan, micro_batches, self.world)
        if lanes is not None:  # a subset of the rank's lanes (e.g. one DataLoader worker's)
            sub = np.asarray(list(lanes), np.int64)
            if sub.ndim != 1 or not sub.size or not np.isin(sub, self.owned).all() or np.any(np.diff(sub) <= 0):
                raise PlanError(f"lanes={list(lanes)} must be a non-empty, increasing subset of the "
                                f"lanes rank {self.rank} of {self.world} owns ({self.owned.tolist()}).")
            self.owned = sub
        follow_blocks(plan, self.sources, len(self.owned))  # block shuffles: sources read blocks whole
        self.all_gather = all_gather
        #: the pass over a finite plan (`repeat()`'s order)
        self.epoch = int(epoch)
        #: source branches of the lanes (a token mix reads each source's lane stream apart)
        self.branches = len(plan.lanes.branches)
        self.token_mix = self.branches > 1
        #: whether batches are random access (every lane position is `step × B/L`)
        self.random_access = self.stages.one_to_one and not self.token_mix
        if plan.remainder == "auto":  # pad where lanes run out at different steps (see Batching)
            pad = not self.random_access and lanes_finite(plan, self.owned, self.branches)
            plan = dataclasses.replace(plan, remainder="pad" if pad else "drop")
        #: the complete plan (block sizes resolved, `remainder` decided)
        self.plan: Batching = plan
        self.runner = runner
        # an operator whose rows are costly (a decoded image) may ask for fewer rows per read
        hints = [getattr(t, "read_ahead_rows", None) for t in self.stages.ops]
        default = min([READ_AHEAD_ROWS, *(int(h) for h in hints if h)])
        #: rows one read aims for
        self.read_ahead = default if read_ahead is None else check_positive_int(read_ahead, "read_ahead")
        #: lane positions relative to the plan's (a random-access run resumed at another batch size)
        self.shift = 0
        #: the next global batch
        self.step = 0
        #: the core, chosen once: exactly one of the two is set
        self.random_core: RandomAccessCore | None = None
        self.lane_core: LaneCore | None = None
        if self.random_access:
            task = StepTask(plan, self.sources, self.stages.rows, self.owned, self.seed, self.epoch)
            self.random_core = RandomAccessCore(task, runner, self.read_ahead)
        else:
            run = LaneRun(plan, self.sources, self.stages, self.owned, self.seed, self.read_ahead, self.branches)
            self.lane_core = LaneCore(run, runner, End(run, all_gather, self.epoch, end))
        #: checks states and positions before anything moves
        self.resume = Resume(plan, self.owned, self.rank, self.world, self.branches, self.stages,
                             self.random_access)
        if self.random_access:
            self.seek(start_step)
        elif start_step != 0:
            raise StateError(f"this pipeline changes the number of records ({self.why()}), so "
                             f"its lanes cannot jump to step {start_step}; restore a state saved "
                             "by state() instead.")

    @property
    def core(self) -> RandomAccessCore | LaneCore:
        """The core this engine runs (`random_core` or `lane_core`)."""
        core = self.random_core or self.lane_core
        assert core is not None
        return core

    @property
    def end(self) -> End | None:
        """The end of a count-changing plan (None on random access: the algebra knows it)."""
        return None if self.lane_core is None else self.lane_core.end

    @property
    def lane_engine(self) -> LaneEngine | None:
        """The lane engine running now (None on random access, or before the first step)."""
        return None if self.lane_core is None else self.lane_core.engine

    def why(self) -> str:
        """What makes this pipeline change the number of records (for error messages)."""
        if self.stages.acc is not None:
            return f"accumulator {self.stages.acc.op_name}"
        if self.token_mix:
            return "a Mix by tokens"
        return ", ".join(t.op_name for t in self.stages.rows if not t.one_to_one)

    # --- stepping --------------------------------------------------------------------------------
    def next_rows(self, emit: Callable[[int, Rows], T], sink: Sink | None = None) -> T:
        """`emit(step, rows)` of the rows of step `self.step`, which the engine then passes (not
        if `emit` raises); StopIteration at the plan's end. `sink` (telemetry) hears of every
        group read or window the core waits for."""
        if self.random_core is not None:
            n = self.num_steps
            if n is not None and self.step >= n:
                raise StopIteration
        out = emit(self.step, self.core.next_rows(self.step, self.epoch, sink))
        self.step += 1
        return out

    def need_random_access(self, what: str) -> RandomAccessCore:
        """The random-access core, or a PlanError saying why `what` needs one."""
        if self.random_core is None:
            raise PlanError(f"{what} needs random access to steps, which this pipeline does not "
                            f"have: {self.why()} makes each lane's position depend on the data "
                            "before it. Iterate the loader, or restore a state saved by state().")
        return self.random_core

    def rows_at(self, step: int) -> tuple[int, Columns, Refs]:
        """Random access to global batch `step`: `(step, cols, refs)`."""
        core = self.need_random_access(f"batch({step})")
        step = self.plan.check_step(step)
        return (step, *core.rows(step))

    def strided(self, start: int, stride: int, sink: Sink | None = None) -> Iterator[tuple[int, Columns, Refs]]:
        """`(step, cols, refs)` of steps start, start+stride, ... (random access; leaves `step`)."""
        core = self.need_random_access("strided()")
        start = self.plan.check_step(start, "strided() start")
        n = self.num_steps
        if n is not None and start >= n:
            return
        for k, (cols, refs) in enumerate(core.strided(start, stride, sink)):
            yield start + k * stride, cols, refs

    @property
    def num_steps(self) -> int | None:
        """Global batches of a random-access run (None if infinite or not random access);
        the plan's `num_steps`, unless it resumed at another batch size."""
        return self.plan.steps_over(self.shift) if self.random_access else self.plan.num_steps

    def stop(self) -> None:
        """Stops work in flight (prefetched groups, the lane engine's windows)."""
        self.core.stop()

    def close(self) -> None:
        """Stops work in flight and closes the runner (its workers and shared memory)."""
        self.stop()
        closer = getattr(self.runner, "close", None)
        if closer is not None:
            closer()

    # --- the end of a finite plan ----------------------------------------------------------------
    @property
    def finite(self) -> bool:
        """Whether the plan ends (and so has epochs and a length)."""
        if self.lane_core is None:
            return self.num_steps is not None
        return self.lane_core.end.finite

    @property
    def unemitted(self) -> Unemitted | None:
        """What the plan's end leaves unemitted in an epoch (`remainder="drop"`), once known."""
        return None if self.lane_core is None else self.lane_core.end.unemitted

    def report_unemitted(self, report: Callable[[Unemitted], None]) -> None:
        """`report(unemitted)` once what a dropping end leaves unemitted is known (telemetry)."""
        if self.lane_core is not None:
            self.lane_core.end.report = report

    def settle_end(self) -> None:
        """Learns the plan's end now if this engine must hear it from other ranks (see `Loader`)."""
        if self.lane_core is not None and self.lane_core.end.agrees(self.epoch):
            self.end_step()

    def end_if_known(self) -> int | None:
        """The plan's end in this epoch if known without counting (else None)."""
        return self.num_steps if self.lane_core is None else self.lane_core.end.ends.get(self.epoch)

    def end_step(self) -> int | None:
        """The step this finite plan ends at in this epoch, the same on every rank; None if it
        repeats forever. A count-changing pipeline counts the first time (`zephon.exec.end`)."""
        if self.lane_core is None:
            return self.num_steps
        return self.lane_core.end_step(self.step, self.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Goes to step 0 of pass `epoch` over a finite plan (the order `repeat()` gives it)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise PlanError(f"epoch must be a non-negative integer, got {epoch!r}")
        if not self.finite:
            raise PlanError("set_epoch() needs a finite plan; this one repeats forever, and its epochs "
                            "are inside it (Repeat re-shuffles each pass).")
        self.stop()
        self.epoch = int(epoch)
        self.step = 0
        self._follow()
        self.core.restart(self.epoch)

    # --- positions -------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What a state must match to be restored here: plan, seed and every operator's identity."""
        return {"plan_fingerprint": self.plan.fingerprint(), "seed": self.seed,
                "pipeline": [op.checked_identity() for op in self.stages.ops]}

    def position(self) -> dict[str, Any]:
        """The step and owned lanes' states (cheap; no identity check)."""
        out: dict[str, Any] = {"step": self.step, "lanes": self.core.lanes_json(self.step, self.shift)}
        if self.shift:
            out["lane_shift"] = self.shift
        if self.epoch:  # the pass over a finite plan (absent: the first)
            out["epoch"] = self.epoch
        return out

    def state_from(self, position: Mapping[str, Any]) -> dict[str, Any]:
        """A full state document from a `position()` taken earlier."""
        import zephon

        out = {"zephon_state": STATE_VERSION, "zephon_version": zephon.__version__, **self.identity(),
               "plan": self.plan.to_json(),
               "step": position["step"], "lanes": position["lanes"]}
        for key in ("lane_shift", "epoch"):
            if position.get(key):
                out[key] = position[key]
        return out

    def seek(self, step: int) -> None:
        """Positions a random-access pipeline at `step` in O(1)."""
        if not self.random_access:
            raise StateError(f"seek() needs random access to steps, which {self.why()} prevents; "
                             "restore a saved state instead.")
        self._moved(self.plan.check_step(step), self.epoch)

    def restore(self, state: Mapping[str, Any], *, allow_batch_change: bool = False) -> None:
        """Continues from `state` (see `Loader.restore`)."""
        shift = self.resume.check(state, self.identity(), allow_batch_change=allow_batch_change)
        if shift is not None and self.lane_core is not None:
            self.lane_core.end.forget()  # lanes went on under other batch sizes: their end is counted anew
        self.seek_position(state, lane_shift=shift)

    def seek_position(self, position: Mapping[str, Any], *, lane_shift: int | None = None) -> None:
        """Continues from a `position()` (or state) without the identity check (see `Loader`)."""
        pos = self.resume.parse(position, lane_shift=lane_shift)
        self.shift = pos.shift
        self._moved(pos.step, pos.epoch)
        if self.lane_core is not None:
            self.lane_core.states = pos.lanes
            if pos.everyone is not None:
                self.lane_core.end.everyone = (pos.step, pos.everyone)

    def _moved(self, step: int, epoch: int) -> None:
        """Puts the engine at `step` of `epoch` (a seek or a restore)."""
        self.stop()
        self.epoch = epoch
        self.step = step
        self._follow()

    def _follow(self) -> None:
        """The core follows a new epoch or lane shift; nothing has ended or been seen."""
        if self.random_core is not None:
            self.random_core.move(self.epoch, self.shift)
        else:
            assert self.lane_core is not None
            self.lane_core.end.restart()


def _check_sources(plan: Batching, sources: Mapping[int, RecordSource]) -> None:
    """Refuses a plan whose sources are missing, shorter than it declares or not Zephon record
    sources, and a token mix that is not the direct child of `.lanes(L)`, naming the fix."""
    for s in leaf_sources(plan):
        if s.id not in sources:
            raise PlanError(f"the plan reads Source id {s.id} ({s.name or 'unnamed'}) but no record "
                            f"source was given for it; pass sources as a list or {{id: source}}.")
        if len(sources[s.id]) < s.size:
            raise PlanError(f"Source id {s.id} declares {s.size} records but its record source "
                            f"has {len(sources[s.id])}; build the plan from len(source).")
    if isinstance(plan.lanes.child, Mix) is False and any(
            isinstance(n, Mix) and n.sequential for n in plan_nodes(plan)):
        raise PlanError("a Mix by tokens (or stop='all') must be the direct child of .lanes(L).")
    for sid, src in sources.items():
        if not callable(getattr(src, "read", None)):
            hint = ("it has __len__ and __getitem__ (a Grain/torch-style source): wrap it in "
                   "zephon.compat.grain.GrainSource (records in one column, for Grain-style "
                   "transforms), or give it read(indices) -> {field: array}" if
                   hasattr(src, "__getitem__") and hasattr(src, "__len__") else
                   "give it __len__ and read(indices) -> {field: array}")
            raise PlanError(f"source {sid} ({type(src).__name__}) is not a Zephon record source: "
                            f"{hint} (e.g. zephon.sources.ArraySource for arrays in memory).")


def _check_picklable(ops: Sequence[Any]) -> None:
    """Worker processes receive the operators pickled: one that cannot be (a lambda, a closure)
    is refused when the loader is built, naming it, rather than at the batch that first ships it."""
    import pickle

    for op in ops:
        chains = getattr(op, "chains", None)
        for inner in ([t for chain in chains.values() for t in chain] if chains else [op]):
            try:
                pickle.dumps(inner, protocol=5)
            except Exception as e:
                raise PlanError(f"operator {getattr(inner, 'op_name', type(inner).__name__)} cannot be "
                                f"pickled for processes() ({type(e).__name__}: {e}); define its "
                                "function at module level (no lambda or closure), or use the "
                                "threads() runner.") from e


__all__ = ["AllGather", "Engine"]

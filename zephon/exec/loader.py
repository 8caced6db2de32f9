"""Plan + sources + lane operators -> the rows of global batches this process owns, with state.

A data-parallel rank materialises only the rows of the lanes it owns. Pipelines whose operators
keep one output per input take the random-access path (`zephon.exec.steps`): lane positions are
`step × B/L`, any step is computed directly and a restore is O(1). Every other pipeline — filters,
flat maps, tokenize-and-split, packing, a mix by tokens — runs on the lane engine
(`zephon.exec.lanes`): windows of lane inputs in parallel on the runner, lanes assembled in order,
per-lane positions and carries in the state. Both paths write the same state format. What it
yields, `LocalBatch` (with `micro_batches(n)`), is defined in `zephon.exec.batch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from zephon.checkpoint import STATE_VERSION
from zephon.errors import PlanError, StateError, check_positive_int
from zephon.exec.accounting import domain_fields
from zephon.exec.batch import LocalBatch, check_micro_count
from zephon.exec.end import FiniteEnd, Unemitted
from zephon.exec.lanes import LaneEngine
from zephon.exec.padding import VALID, Schema
from zephon.exec.pipeline import LanePipeline
from zephon.exec.resize import check_micro_schedule
from zephon.exec.resume import Resumable
from zephon.exec.state import LaneState, check_state, merge_states
from zephon.exec.steps import READ_AHEAD_ROWS, StepTask, as_source_map, iterate_steps
from zephon.ops.base import JSON, Operator, run_transforms
from zephon.pipeline import How, Pipeline, Where, split_old_form
from zephon.plan import Batching, Mix, Refs
from zephon.plan.blockshuffle import follow_blocks, resolve_blocks
from zephon.plan.walk import leaf_sources, plan_nodes
from zephon.sources.base import Columns
from zephon.telemetry import StageSink, Stats, Telemetry
from zephon.telemetry import make as telemetry_recorder
from zephon.telemetry import require as require_telemetry


class Loader(FiniteEnd, Resumable):
    """Iterates global batches `start, start+1, ...` of a pipeline, materialising owned rows only.

    Args:
      pipeline: a `zephon.Pipeline(plan, sources, ops, per_source=, seed=)`: what is read.
      where: a `zephon.Where(rank=, world=, lanes=, all_gather=)`: this process's data-parallel
        rank of `world` (default 0 of 1); `lanes` produces only these of the rank's lanes (in
        lane order) — how DataLoader workers split a rank's lanes; `position()`/`state()` then
        cover just them (merge them); `all_gather` is how ranks agree on a finite count-changing
        plan's end (`zephon.exec.end`; without one, each counts all lanes).
      how: a `zephon.How(runner=, read_ahead=, telemetry=, micro_batches=, domains=)`: speed and
        reporting, never data (see `zephon.How`). `close()` closes the runner.
      start_step: first global batch (random-access pipelines; others restore a state).
      epoch: the pass over a finite plan (`repeat()`'s order); `set_epoch(e)`; in the state.
      end: the plan's end step if known already (a DataLoader's workers are told it): no counting.

    The old form `Loader(plan, sources, transforms, seed=, rank=, world=, runner=, ...)` works
    for this version with a `DeprecationWarning` naming the new one.

    A finite plan ends at the same step on every rank (`Batching.remainder`); `len()`: steps left.
    """

    @overload
    def __init__(self, pipeline: Pipeline, where: Where | None = None, how: How | None = None, *,
                 start_step: int = 0, epoch: int = 0, end: int | None = None) -> None: ...

    @overload  # deprecated: Loader(plan, sources, transforms, seed=, rank=, world=, runner=, ...)
    def __init__(self, pipeline: Batching, where: Any, how: Sequence[Any] = (), *,
                 start_step: int = 0, epoch: int = 0, end: int | None = None, **old_form: Any) -> None: ...

    def __init__(self, pipeline: Pipeline | Batching, where: Any = None, how: Any = None, *,
                 start_step: int = 0, epoch: int = 0, end: int | None = None, **old_form: Any) -> None:
        if not isinstance(pipeline, Pipeline):  # Loader(plan, sources, transforms, **options)
            start_step = old_form.pop("start_step", start_step)
            pipeline, where, how, rest = split_old_form(
                "zephon.Loader", pipeline, where, old_form.pop("transforms", how), old_form)
            if rest:
                raise TypeError(f"Loader() got unexpected keyword arguments {sorted(rest)}")
        elif old_form:
            raise TypeError(f"Loader(pipeline, where=, how=) got unexpected keyword arguments {sorted(old_form)}; "
                            "rank/world/lanes/all_gather go in zephon.Where, runner/read_ahead/telemetry/"
                            "micro_batches/domains in zephon.How.")
        where = Where() if where is None else where
        how = How() if how is None else how
        for what, v, cls in (("where", where, Where), ("how", how, How)):
            if not isinstance(v, cls):
                raise PlanError(f"Loader({what}=...) takes a zephon.{cls.__name__}, got {type(v).__name__}")
        #: the value this loader reads, and its two option groups
        self.pipeline, self.where, self.how = pipeline, where, how
        plan, sources, transforms = pipeline.plan, pipeline.sources, pipeline.ops
        per_source, seed = pipeline.per_source, pipeline.seed
        rank, world = where.rank_world()
        lanes, all_gather = where.lanes, where.all_gather
        runner, read_ahead, telemetry = how.runner, how.read_ahead, how.telemetry
        micro_batches, domains = how.micro_batches, how.domains
        if not isinstance(plan, Batching):
            raise PlanError("Loader needs a complete plan: stream.lanes(L).batch(B)")
        self.sources = as_source_map(sources)
        plan = resolve_blocks(plan, self.sources)  # block_shuffle(block="auto"): the sources' unit
        self.plan = plan
        for s in leaf_sources(plan):
            if s.id not in self.sources:
                raise PlanError(f"the plan reads Source id {s.id} ({s.name or 'unnamed'}) but no record "
                                f"source was given for it; pass sources as a list or {{id: source}}.")
            if len(self.sources[s.id]) < s.size:
                raise PlanError(f"Source id {s.id} declares {s.size} records but its record source "
                                f"has {len(self.sources[s.id])}; build the plan from len(source).")
        if isinstance(plan.lanes.child, Mix) is False and any(
                isinstance(n, Mix) and n.sequential for n in plan_nodes(plan)):
            raise PlanError("a Mix by tokens (or stop='all') must be the direct child of .lanes(L).")
        for sid, src in self.sources.items():
            if not callable(getattr(src, "read", None)):
                hint = ("it has __len__ and __getitem__ (a Grain/torch-style source): wrap it in "
                       "zephon.compat.grain.GrainSource (records in one column, for Grain-style "
                       "transforms), or give it read(indices) -> {field: array}" if
                       hasattr(src, "__getitem__") and hasattr(src, "__len__") else
                       "give it __len__ and read(indices) -> {field: array}")
                raise PlanError(f"source {sid} ({type(src).__name__}) is not a Zephon record source: "
                                f"{hint} (e.g. zephon.sources.ArraySource for arrays in memory).")
        self.domains = bool(domains)
        self._n_sources = max((s.id for s in leaf_sources(plan)), default=0) + 1
        self.stages = LanePipeline.split(transforms, per_source)
        self.transforms = self.stages.ops
        if getattr(runner, "pickles", False):  # processes(): say so now, not at some later batch
            _check_picklable(self.transforms)
        for what, v in (("seed", seed), ("rank", rank), ("world", world), ("epoch", epoch)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise PlanError(f"Loader({what}=...) must be a non-negative integer, got {v!r}")
        self.seed = int(seed)
        self.rank, self.world = int(rank), int(world)
        self.owned = plan.lanes.owned(self.rank, self.world)
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
        self.epoch = int(epoch)
        self._ends: dict[int, int | None] = {} if end is None else {self.epoch: int(end)}
        self._schema: Schema | None = None
        self._done = False  # the plan ended here (no more batches until set_epoch/restore)
        self._exhausted = False  # every owned lane ran out: the steps left to the end are padding
        #: every lane's state at a step, from a merged state restored here (for counting the end)
        self._everyone: tuple[int, list[LaneState]] | None = None
        self.branches = len(plan.lanes.branches)
        self.token_mix = self.branches > 1
        #: Whether batches are random access (every lane position is `step × B/L`).
        self.random_access = self.stages.one_to_one and not self.token_mix
        self.one_to_one = self.random_access
        if plan.remainder == "auto":  # pad where lanes run out at different steps (see Batching)
            self.plan = plan = dataclasses.replace(
                plan, remainder="pad" if not self.random_access and self.finite else "drop")
        #: what the plan's end leaves unemitted in an epoch (`remainder="drop"`), once known
        self.unemitted: Unemitted | None = None
        self._unemitted_said = False
        self._seen = [0, 0]
        self.runner = runner
        # an operator whose rows are costly (a decoded image) may ask for fewer rows per read
        hints = [getattr(t, "read_ahead_rows", None) for t in self.stages.ops]
        default = min([READ_AHEAD_ROWS, *(int(h) for h in hints if h)])
        self.read_ahead = default if read_ahead is None else check_positive_int(read_ahead, "read_ahead")
        #: lane positions relative to the plan's (a random-access run resumed at another batch size)
        self._shift = 0
        self._task = StepTask(plan, self.sources, self.stages.rows, self.owned, self.seed, self.epoch)
        self._pending: Iterator[tuple[Columns, Refs]] | None = None
        self._busy = False  # a batch is being produced (a second thread gets a clear error)
        self._engine: LaneEngine | None = None
        self._step = 0
        self._lane_states: list[LaneState] = []
        n = plan.num_steps
        self._tel = telemetry_recorder(telemetry, None if n is None or not isinstance(start_step, int)
                                       else max(0, n - start_step), getattr(runner, "workers", 1))
        self._sink = StageSink(self._tel) if self._tel is not None else None
        if self.random_access:
            self.seek(start_step)
        else:
            if start_step != 0:
                raise StateError(f"this pipeline changes the number of records ({self._why()}), so "
                                 f"its lanes cannot jump to step {start_step}; restore a state saved "
                                 "by state() instead.")
            self._lane_states = self._start_states()

    def _start_states(self, lanes: np.ndarray | None = None) -> list[LaneState]:
        return [LaneState.start(self.branches, 0, self.token_mix)
                for _ in (self.owned if lanes is None else lanes)]

    def _why(self) -> str:
        if self.stages.acc is not None:
            return f"accumulator {self.stages.acc.op_name}"
        if self.token_mix:
            return "a Mix by tokens"
        return ", ".join(t.op_name for t in self.stages.rows if not t.one_to_one)

    # --- iteration ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The next global batch this loader will yield."""
        return self._step

    def __iter__(self) -> Loader:
        return self

    def _batch(self, step: int, cols: Columns, refs: Refs | None = None,
               segments: Any = None, valid: np.ndarray | None = None) -> LocalBatch:
        per = self.plan.per_lane_at(step)
        if self.stages.post:
            post_refs = Refs(np.repeat(self.owned, per),
                             self.plan.lane_offset(step) + self._shift + np.tile(np.arange(per), len(self.owned)),
                             np.full(len(self.owned) * per, -1, np.int64))
            cols, _ = run_transforms(self.stages.post, cols, post_refs, self.seed ^ 0x5EED)
        if self.domains:
            cols = {**cols, **domain_fields(cols, refs, segments, self._n_sources)}
        if self.plan.pad:
            if valid is None:
                valid = refs.source >= 0 if refs is not None else np.ones(len(self.owned) * per, bool)
            cols = {**cols, VALID: valid}
        return LocalBatch(step, cols, self.owned, per, self.plan.size_at(step), refs, segments)

    @property
    def num_steps(self) -> int | None:
        """Global batches of a random-access run (None if infinite or not random access);
        the plan's `num_steps`, unless it resumed at another batch size."""
        return self.plan.steps_over(self._shift) if self.random_access else self.plan.num_steps

    def __next__(self) -> LocalBatch:
        if self._busy:
            raise PlanError("this Loader is already producing a batch in another thread: a loader "
                            "is not shareable between threads. Build one loader per thread (e.g. "
                            "Loader(..., lanes=...) over disjoint lanes, merged with merge_states), "
                            "or hand batches from one thread to the others through a queue.")
        self._busy = True
        try:
            return self._next() if self._sink is None else self._sink.step(self._next)
        finally:
            self._busy = False

    def stats(self) -> Stats:
        """Telemetry so far: stall, stage times, rows/tokens/bytes (see `zephon.telemetry`)."""
        return require_telemetry(self._tel, "this Loader").stats()

    @property
    def telemetry(self) -> Telemetry | None:
        """The recorder behind `stats()` (None when built with telemetry=False)."""
        return self._tel

    def _next(self) -> LocalBatch:
        sink = self._sink
        if self.random_access:
            n = self.num_steps
            if n is not None and self._step >= n:
                raise StopIteration
            if self._pending is None:
                self._pending = iterate_steps(self._task, self.runner, self._step, self.read_ahead,
                                              sink=sink)
            try:
                cols, refs = next(self._pending)
            except BaseException:
                self._stop_pending()  # the next call starts afresh at the same step
                raise
            batch = self._batch(self._step, cols, refs)
        else:
            cols, prov, valid = self._engine_step(sink)
            if isinstance(prov, Refs):
                batch = self._batch(self._step, cols, refs=prov, valid=valid)
            else:
                batch = self._batch(self._step, cols, segments=prov, valid=valid)
        self._step += 1
        return batch

    def _stop_pending(self) -> None:
        pending, self._pending = self._pending, None
        closer = getattr(pending, "close", None)
        if closer is not None:
            closer()
        engine, self._engine = self._engine, None
        if engine is not None:
            self._lane_states = engine.states
            engine.close()

    def _moved(self, step: int, epoch: int) -> None:
        """The loader was put at `step` of `epoch` (a seek or a restore)."""
        self._stop_pending()
        if epoch != self.epoch:
            self.epoch = epoch
            self._task = dataclasses.replace(self._task, epoch=epoch)
        self._step = step
        self._done = self._exhausted = False
        self._everyone = None
        self._seen = [0, 0]

    def _need_random_access(self, what: str) -> None:
        if not self.random_access:
            raise PlanError(f"{what} needs random access to steps, which this pipeline does not "
                            f"have: {self._why()} makes each lane's position depend on the data "
                            "before it. Iterate the loader, or restore a state saved by state().")

    def strided(self, start: int, stride: int) -> Iterator[LocalBatch]:
        """Batches start, start+stride, ... with grouped reads, for splitting steps among
        workers (worker w of W takes `strided(first + w, W)`). Leaves `self.step` alone."""
        self._need_random_access("strided()")
        start = self.plan.check_step(start, "strided() start")
        n = self.num_steps
        if n is not None and start >= n:
            return
        sink = self._sink
        for k, (cols, refs) in enumerate(iterate_steps(self._task, self.runner, start, self.read_ahead, stride,
                                                       sink=sink)):
            yield self._batch(start + k * stride, cols, refs)

    def batch(self, step: int) -> LocalBatch:
        """Random access to global batch `step` (random-access pipelines only)."""
        self._need_random_access(f"batch({step})")
        step = self.plan.check_step(step)
        cols, refs = self._task(step)
        return self._batch(step, cols, refs)

    def close(self) -> None:
        """Stops prefetching and closes the runner (its workers and shared memory)."""
        self._stop_pending()
        if self._tel is not None:
            self._tel.close()
        closer = getattr(self.runner, "close", None)
        if closer is not None:
            closer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- state ---------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What a state must match to be restored here: plan, seed and every operator's identity."""
        return {"plan_fingerprint": self.plan.fingerprint(), "seed": self.seed,
                "pipeline": [op.checked_identity() for op in self.transforms]}

    def position(self) -> dict[str, Any]:
        """The step and owned lanes' states (cheap; no identity check — see `state`)."""
        if self.random_access:
            at = self.plan.lane_offset(self._step) + self._shift
            lanes = {str(int(l)): LaneState.start(1, at).to_json() for l in self.owned}
        else:
            acc = self.stages.acc is not None
            states = self._engine.states if self._engine is not None else self._lane_states
            lanes = {str(int(l)): s.to_json(acc) for l, s in zip(self.owned, states)}
        out: dict[str, Any] = {"step": self._step, "lanes": lanes}
        if self._shift:
            out["lane_shift"] = self._shift
        if self.epoch:  # the pass over a finite plan (absent: the first)
            out["epoch"] = self.epoch
        return out

    def state_from(self, position: Mapping[str, Any]) -> dict[str, Any]:
        """A full state document from a `position()` taken earlier (backends prefetch ahead)."""
        import zephon

        out = {"zephon_state": STATE_VERSION, "zephon_version": zephon.__version__, **self.identity(),
               "plan": self.plan.to_json(),
               "step": position["step"], "lanes": position["lanes"]}
        for key in ("lane_shift", "epoch"):
            if position.get(key):
                out[key] = position[key]
        return out

    def state(self) -> dict[str, Any]:
        """JSON state after the last yielded batch: identity, step, owned lanes' states."""
        return self.state_from(self.position())

    def seek(self, step: int) -> None:
        """Positions a random-access pipeline at `step` in O(1)."""
        if not self.random_access:
            raise StateError(f"seek() needs random access to steps, which {self._why()} prevents; "
                             "restore a saved state instead.")
        self._moved(self.plan.check_step(step), self.epoch)


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



__all__ = ["JSON", "LaneState", "Loader", "LocalBatch", "Operator", "check_micro_count", "check_micro_schedule",
           "check_state", "merge_states"]

"""`zephon.Loader`: the numpy emitter — the rows of global batches this process owns, with state.

A data-parallel rank materialises only the rows of the lanes it owns. Which rows, where the
lanes stand, where a finite plan ends and how a state resumes are the run's business: the
`Engine` (`zephon.exec.engine`) checks the run once and holds one of two cores — random access
(`zephon.exec.steps`: lane positions `step × B/L`, any step directly, O(1) restore) for
pipelines whose operators keep one output per input, the lane engine (`zephon.exec.lanes`) for
every other (filters, flat maps, tokenize-and-split, packing, a mix by tokens). Both write the
same state format. The loader is the thin layer on top: it turns each step's rows into a
`LocalBatch` (`zephon.exec.batch`, with `micro_batches(n)`) and keeps telemetry; the JAX, torch
and Grain emitters wrap a `Loader`. Terms: docs/glossary.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from zephon.errors import PlanError
from zephon.exec.accounting import domain_fields
from zephon.exec.batch import LocalBatch, check_micro_count
from zephon.exec.cores import Rows
from zephon.exec.end import AllGather, Unemitted
from zephon.exec.engine import Engine
from zephon.exec.padding import VALID
from zephon.exec.pipeline import LanePipeline
from zephon.exec.resize import check_micro_schedule
from zephon.exec.state import LaneState, check_state, merge_states
from zephon.ops.base import JSON, Operator, run_transforms
from zephon.pipeline import How, Pipeline, Where, no_rest, read_call
from zephon.plan import Batching, Refs
from zephon.sources.base import Columns, RecordSource
from zephon.telemetry import StageSink, Stats, Telemetry
from zephon.telemetry import make as telemetry_recorder
from zephon.telemetry import require as require_telemetry

if TYPE_CHECKING:  # annotation only: importing zephon.runners here would load it with the core
    from zephon.runners.base import Runner


class Loader:
    """Iterates global batches `start, start+1, ...` of a pipeline, materialising owned rows only.

    Args:
      pipeline: a `zephon.Pipeline(plan, sources, ops, per_source=, seed=)`: what is read.
      where: a `zephon.Where(rank=, world=, lanes=, all_gather=)`: this process's data-parallel
        rank of `world` (default 0 of 1); `lanes` produces only these of the rank's lanes (in
        lane order) — how DataLoader workers split a rank's lanes; `position()`/`state()` then
        cover just them (merge them); `all_gather` is how ranks agree on a finite count-changing
        plan's end (`zephon.exec.end`; without one, each counts all lanes).
      how: a `zephon.How(runner=, read_ahead=, telemetry=, micro_batches=, domains=)`: speed and
        reporting, never data (see `zephon.How`); `prefetch` means nothing here (the numpy loader
        computes ahead through its runner). `close()` closes the runner.
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
        call = read_call("zephon.Loader", pipeline, where, how, old_form)
        no_rest("Loader", call.rest)
        pipeline, where, how = call.pipeline, call.where, call.how
        #: the value this loader reads, and its two option groups
        self.pipeline, self.where, self.how = pipeline, where, how
        #: add per-domain accounting fields to every batch (`How.domains`)
        self.domains = bool(how.domains)
        #: the run and its core: rows, positions, the end, resume (`zephon.exec.engine`)
        self.engine = Engine(pipeline, where, how, start_step=start_step, epoch=epoch, end=end)
        n = self.engine.plan.num_steps
        self._tel = telemetry_recorder(how.telemetry, None if n is None or not isinstance(start_step, int)
                                       else max(0, n - start_step), getattr(how.runner, "workers", 1))
        if self._tel is not None:  # stats().unemitted (the recorder, not the loader: no cycle)
            self.engine.report_unemitted(_UnemittedTo(self._tel))
        self._sink = StageSink(self._tel) if self._tel is not None else None
        self._busy = False  # a batch is being produced (a second thread gets a clear error)

    # --- the run (the engine's; read-only here) ------------------------------------------------
    @property
    def plan(self) -> Batching:
        """The complete plan: block sizes resolved, `remainder="auto"` decided."""
        return self.engine.plan

    @property
    def sources(self) -> dict[int, RecordSource]:
        """`{Source id: record source}`."""
        return self.engine.sources

    @property
    def stages(self) -> LanePipeline:
        """The lane pipeline (per-source and row operators, accumulator, one-to-one after it)."""
        return self.engine.stages

    @property
    def transforms(self) -> tuple[Any, ...]:
        """Every lane operator, in order (`stages.ops`)."""
        return self.engine.stages.ops

    @property
    def seed(self) -> int:
        """Seeds data-derived randomness (`Pipeline.seed`)."""
        return self.engine.seed

    @property
    def rank(self) -> int:
        """This process's data-parallel rank."""
        return self.engine.rank

    @property
    def world(self) -> int:
        """The data-parallel degree."""
        return self.engine.world

    @property
    def owned(self) -> np.ndarray:
        """The lanes this loader produces, in lane order."""
        return self.engine.owned

    @property
    def all_gather(self) -> AllGather | None:
        """How ranks agree on a finite count-changing plan's end (`Where.all_gather`)."""
        return self.engine.all_gather

    @property
    def epoch(self) -> int:
        """The pass over a finite plan (`set_epoch`)."""
        return self.engine.epoch

    @property
    def branches(self) -> int:
        """Source branches of the lanes (more than one: a mix by tokens)."""
        return self.engine.branches

    @property
    def token_mix(self) -> bool:
        """Whether lanes follow a mix by tokens."""
        return self.engine.token_mix

    @property
    def random_access(self) -> bool:
        """Whether batches are random access (every lane position is `step × B/L`)."""
        return self.engine.random_access

    @property
    def one_to_one(self) -> bool:
        """The same as `random_access`."""
        return self.engine.random_access

    @property
    def runner(self) -> Runner | None:
        """The runner computing steps or windows ahead (`How.runner`)."""
        return self.engine.runner

    @property
    def read_ahead(self) -> int:
        """Rows one read aims for."""
        return self.engine.read_ahead

    @property
    def unemitted(self) -> Unemitted | None:
        """What the plan's end leaves unemitted in an epoch (`remainder="drop"`), once known."""
        return self.engine.unemitted

    # --- iteration ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The next global batch this loader will yield."""
        return self.engine.step

    def __iter__(self) -> Loader:
        return self

    def _batch(self, step: int, cols: Columns, refs: Refs | None = None,
               segments: Any = None, valid: np.ndarray | None = None) -> LocalBatch:
        """A step's rows as this process's `LocalBatch`: one-to-one operators after an
        accumulator, per-domain fields (`domains`), the `valid` field of a padded plan."""
        plan, owned = self.engine.plan, self.engine.owned
        per = plan.per_lane_at(step)
        if self.engine.stages.post:
            post_refs = Refs(np.repeat(owned, per),
                             plan.lane_offset(step) + self.engine.shift + np.tile(np.arange(per), len(owned)),
                             np.full(len(owned) * per, -1, np.int64))
            cols, _ = run_transforms(self.engine.stages.post, cols, post_refs, self.engine.seed ^ 0x5EED)
        if self.domains:
            cols = {**cols, **domain_fields(cols, refs, segments, self.engine.n_sources)}
        if plan.pad:
            if valid is None:
                valid = refs.source >= 0 if refs is not None else np.ones(len(owned) * per, bool)
            cols = {**cols, VALID: valid}
        return LocalBatch(step, cols, owned, per, plan.size_at(step), refs, segments)

    def _emit(self, step: int, rows: Rows) -> LocalBatch:
        cols, prov, valid = rows
        if isinstance(prov, Refs):
            return self._batch(step, cols, refs=prov, valid=valid)
        return self._batch(step, cols, segments=prov, valid=valid)

    @property
    def num_steps(self) -> int | None:
        """Global batches of a random-access run (None if infinite or not random access);
        the plan's `num_steps`, unless it resumed at another batch size."""
        return self.engine.num_steps

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
        return self.engine.next_rows(self._emit, self._sink)

    def strided(self, start: int, stride: int) -> Iterator[LocalBatch]:
        """Batches start, start+stride, ... with grouped reads, for splitting steps among
        workers (worker w of W takes `strided(first + w, W)`). Leaves `self.step` alone."""
        for step, cols, refs in self.engine.strided(start, stride, self._sink):
            yield self._batch(step, cols, refs)

    def batch(self, step: int) -> LocalBatch:
        """Random access to global batch `step` (random-access pipelines only)."""
        step, cols, refs = self.engine.rows_at(step)
        return self._batch(step, cols, refs)

    def close(self) -> None:
        """Stops prefetching and closes the runner (its workers and shared memory)."""
        self.engine.stop()
        if self._tel is not None:
            self._tel.close()
        self.engine.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the end of a finite plan --------------------------------------------------------------
    @property
    def finite(self) -> bool:
        """Whether the plan ends (and so has epochs and a length)."""
        return self.engine.finite

    def settle_end(self) -> None:
        """Learns the plan's end now if this loader must hear it from other ranks (a finite
        count-changing plan at world > 1): the emitters call it on every rank, from the thread
        that runs collectives, when an epoch starts or a state is restored. No-op otherwise."""
        self.engine.settle_end()

    def end_if_known(self) -> int | None:
        """The plan's end in this epoch if known without counting (else None)."""
        return self.engine.end_if_known()

    def end_step(self) -> int | None:
        """The step this finite plan ends at in this epoch (its number of global batches), the
        same on every rank; None if it repeats forever. For a pipeline that changes the number
        of records the first call counts (see `zephon.exec.end`): every rank must call it (the
        emitters do, when they start an epoch)."""
        return self.engine.end_step()

    def __len__(self) -> int:
        """Global batches left in this epoch of a finite plan (TypeError if it repeats forever).

        With `remainder="drop"` and a pipeline that changes the number of records, the count
        also finds what the end leaves unemitted: `loader.unemitted` (and `stats().unemitted`),
        logged as a warning when it is more than one global batch. "pad" leaves nothing."""
        end = self.end_step()
        if end is None:
            raise TypeError("this Zephon loader has no length: its plan repeats forever "
                            "(build it without .repeat() or with .repeat(count)).")
        return max(0, end - self.engine.step)

    def set_epoch(self, epoch: int) -> None:
        """Goes to step 0 of pass `epoch` over a finite plan (the order `repeat()` gives it)."""
        self.engine.set_epoch(epoch)

    # --- state ---------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What a state must match to be restored here: plan, seed and every operator's identity."""
        return self.engine.identity()

    def position(self) -> dict[str, Any]:
        """The step and owned lanes' states (cheap; no identity check — see `state`)."""
        return self.engine.position()

    def state_from(self, position: Mapping[str, Any]) -> dict[str, Any]:
        """A full state document from a `position()` taken earlier (backends prefetch ahead)."""
        return self.engine.state_from(position)

    def state(self) -> dict[str, Any]:
        """JSON state after the last yielded batch: identity, step, owned lanes' states."""
        return self.state_from(self.position())

    def seek(self, step: int) -> None:
        """Positions a random-access pipeline at `step` in O(1)."""
        self.engine.seek(step)

    def restore(self, state: Mapping[str, Any], *, allow_batch_change: bool = False) -> None:
        """Continues from `state` (saved at any data-parallel degree of the same plan).

        A state saved under another global batch size (or schedule) of the same plan is
        refused, naming both, unless `allow_batch_change=True`: then every lane continues
        exactly where it stopped — no record skipped or repeated — and the batches from the
        saved step on are this plan's sizes (`zephon.plan.batchsizes`).
        """
        self.engine.restore(state, allow_batch_change=allow_batch_change)

    def seek_position(self, position: Mapping[str, Any], *, lane_shift: int | None = None) -> None:
        """Continues from a `position()` (or state) of a loader of the same plan and pipeline
        whose lanes include this one's, without the identity check of `restore` — for backends
        that hand positions between their own workers in one job (pipelines with lambdas too).
        `lane_shift` overrides the position's (a resume at another batch size)."""
        self.engine.seek_position(position, lane_shift=lane_shift)


class _UnemittedTo:
    """Hands what the plan's end leaves unemitted to a telemetry recorder (`stats().unemitted`)."""

    def __init__(self, tel: Telemetry) -> None:
        self.tel = tel

    def __call__(self, found: Unemitted) -> None:
        self.tel.unemitted = found


__all__ = ["JSON", "LaneState", "Loader", "LocalBatch", "Operator", "check_micro_count", "check_micro_schedule",
           "check_state", "merge_states"]

"""`JaxLoader`: global batches as dicts of sharded `jax.Array`s, prefetched to device.

Because the loader's global batch is a function of the plan and the step only, the arrays are
identical for every mesh shape, number of processes and prefetch depth; only their placement
differs. A background thread (`prefetch`) builds the next batches on the host while the train
step runs, with a bounded queue, and `state()` describes the batches the *caller* consumed, not
the ones prefetched.
"""

from __future__ import annotations

import collections
import copy
import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, overload

import jax
from jax.sharding import NamedSharding

from zephon.backends.doors import refuse
from zephon.backends.jax.batch import Emitter, JaxBatch
from zephon.backends.jax.placement import (
    Shardings,
    batch_sharding,
    check_shardings,
    describe_batch_axes,
    num_batch_shards,
    plan_layout,
)
from zephon.backends.jax.prefetch import End, Failure, Prefetcher
from zephon.errors import PlanError, WorkerError
from zephon.exec.loader import Loader, LocalBatch
from zephon.exec.resize import check_micro_schedule
from zephon.pipeline import How, Pipeline, Where, no_rest, read_call
from zephon.plan import Batching
from zephon.telemetry import Stats
from zephon.telemetry import make as telemetry_recorder
from zephon.telemetry import require as require_telemetry

log = logging.getLogger(__name__)


class JaxLoader:
    """Global batches as dicts of sharded `jax.Array`s, prefetched to device.

    Args:
      pipeline: a `zephon.Pipeline(plan, sources, ops, per_source=, seed=)`: what is read.
      where: a `zephon.Where` naming the placement, one of:
        `Where(mesh=, batch_axes=)`: the batch dim is split over `batch_axes` (a mesh axis name
        or a tuple of names; default "data"); every field gets `NamedSharding(mesh,
        PartitionSpec(batch_axes))`.
        `Where(sharding=)`: a `NamedSharding` for every field, or a mapping field ->
        `NamedSharding` (e.g. tokens also split over a sequence axis). The batch dim's
        partitioning must be the same for every field.
        The process's data-parallel rank and degree are *derived* from it and
        `jax.process_index()`, so `rank`, `world`, `group` and `lanes` are refused;
        `all_gather` defaults to one through `jax.distributed` when there are several processes.
      how: a `zephon.How`:
        `prefetch`: batches kept in flight to the devices ahead of the caller; a background
        thread loads and converts them on the host, and their transfers are dispatched
        (asynchronously) from the caller's thread (0: build each batch when asked, in the
        caller's thread). Memory holds at most 2 * prefetch + 1 batches beyond the caller's.
        `telemetry`: True (default), False or a `zephon.Telemetry(...)`: `stats()` — how long the
        caller waited in `next()` (stall %), the loader's stages and the emit stage (host
        conversion and transfer dispatch; with prefetch=0 the transfer itself).
        `micro_batches`: the micro-batch count the train step cuts every batch into: checked up
        front against every size of the plan's batch-size schedule, per device block of rows.
        `runner`, `read_ahead`, `domains`: as for `zephon.Loader`.
      start_step: first global batch (random-access pipelines; others restore a state).
      exclude: fields not to emit (e.g. raw bytes kept for debugging in the numpy backend).

    The old form `JaxLoader(plan, sources, transforms, mesh=, batch_axes=, prefetch=, seed=,
    ...)` works for this version with a `DeprecationWarning` naming the new one.

    With a batch-size schedule (`batch(schedule=...)`) the arrays' leading dim is `B(k)` at step
    k, so a `jax.jit`-compiled train step retraces (and compiles) once per distinct batch size —
    a ramp of 3 sizes compiles 3 times, then hits the cache.

    Use it as a context manager or call `close()` to stop the prefetch thread promptly.

    A finite plan ends at the same step in every process (they agree through `jax.distributed`
    when its pipeline changes the number of records; see `zephon.exec.end`); `len()` is the
    steps left and `set_epoch(e)` goes to step 0 of pass `e`.
    """

    @overload
    def __init__(self, pipeline: Pipeline, where: Where | None = None, how: How | None = None, *,
                 start_step: int = 0, exclude: Sequence[str] = ()) -> None: ...

    @overload  # deprecated: JaxLoader(plan, sources, transforms, mesh=, prefetch=, seed=, ...)
    def __init__(self, pipeline: Batching, where: Any, how: Sequence[Any] = (), *,
                 start_step: int = 0, exclude: Sequence[str] = (), **old_form: Any) -> None: ...

    def __init__(self, pipeline: Pipeline | Batching | None = None, where: Any = None, how: Any = None, *,
                 start_step: int = 0, exclude: Sequence[str] = (), **old_form: Any) -> None:
        call = read_call("zephon.backends.jax.JaxLoader", pipeline, where, how, old_form)
        no_rest("JaxLoader", call.rest)
        where, how = call.where, call.how
        #: the value this loader reads, and its two option groups
        self.pipeline, self.where, self.how = call.pipeline, where, how
        plan = call.pipeline.plan
        refuse("JaxLoader", where, ("rank", "world", "group", "lanes"),
               "a JAX process's rows are the block its devices hold, derived from the mesh; pass "
               "Where(mesh=, batch_axes=) or Where(sharding=) only.")
        if where.mesh is not None and where.sharding is None:
            shardings: Shardings = batch_sharding(where.mesh, "data" if where.batch_axes is None
                                                  else where.batch_axes)
        elif where.sharding is not None and where.mesh is None and where.batch_axes is None:
            shardings = check_shardings(where.sharding)
        else:
            raise PlanError("JaxLoader needs either mesh= (Where(mesh=, batch_axes=)) or sharding= "
                            "(Where(sharding=)), not both or neither.")
        n = plan.num_steps
        self._tel = telemetry_recorder(how.telemetry, None if n is None else max(0, n - start_step))
        self.emit = Emitter(shardings, frozenset(exclude), self._tel)
        first = shardings if isinstance(shardings, NamedSharding) else next(iter(shardings.values()))
        self.layout = plan_layout(plan, first)
        if how.micro_batches is not None:
            check_micro_schedule(plan, how.micro_batches, num_batch_shards(first))
        log.info("process %d loads row block %d of %d of every global batch (%s)", jax.process_index(),
                 self.layout.rank, self.layout.world, describe_batch_axes(first))
        self.prefetch = how.prefetch
        gather = where.all_gather
        if gather is None and jax.process_count() > 1:
            gather = _process_all_gather()
        # the numpy loader gets the rank the mesh decided; micro-batches were checked per device
        self._loader = Loader(call.pipeline,
                              replace(where, mesh=None, batch_axes=None, sharding=None, rank=self.layout.rank,
                                      world=self.layout.world, all_gather=gather),
                              replace(how, telemetry=self._tel is not None, micro_batches=None),
                              start_step=start_step)
        if self._tel is not None and self._loader.telemetry is not None:
            self._tel.include(self._loader.telemetry)
        self._loader.settle_end()  # here, not in the prefetch thread: it may run a collective
        self._state = self._loader.position()
        self._prefetcher: Prefetcher | None = None
        self._finalizer: weakref.finalize | None = None
        self._abandoned = False  # a prefetch thread did not stop in time (see zephon.runners.closing)
        self._ended: End | Failure | None = None
        self._ahead: collections.deque[tuple[JaxBatch, dict[str, Any], LocalBatch]] = collections.deque()
        self._provenance: LocalBatch | None = None
        self._last: End | Failure | None = None  # what the producer ended with, after _ahead

    @property
    def step(self) -> int:
        """The next global batch the caller will receive."""
        return int(self._state["step"])

    def __iter__(self) -> JaxLoader:
        return self

    def __len__(self) -> int:
        """Global batches left in this epoch of a finite plan (TypeError if it repeats forever)."""
        if self._loader.end_if_known() is None and self._loader.finite:
            # counting reads the loader's lanes: not while the prefetch thread moves them
            self._halt()
            self._loader.seek_position(self._state)
        end = self._loader.end_step()
        if end is None:
            raise TypeError("this JaxLoader has no length: its plan repeats forever.")
        return max(0, end - self.step)

    @property
    def epoch(self) -> int:
        return int(self._state.get("epoch", 0))

    def set_epoch(self, epoch: int) -> None:
        """Goes to step 0 of pass `epoch` over the finite plan (the order `repeat()` gives it)."""
        self._halt()
        self._loader.set_epoch(epoch)
        self._loader.settle_end()
        self._state = self._loader.position()
        self._ended = None

    def __next__(self) -> JaxBatch:
        if self._tel is None:
            return self._next_arrays()
        return self._tel.step(self._next_arrays)

    def stats(self) -> Stats:
        """Telemetry so far: stall %, stage times, rows/tokens/bytes (see `zephon.telemetry`)."""
        return require_telemetry(self._tel, "this JaxLoader").stats()

    def _next_arrays(self) -> JaxBatch:
        if isinstance(self._ended, Failure):
            raise self._ended.error
        if self._ended is not None:
            raise StopIteration
        if self.prefetch == 0:
            try:
                batch = next(self._loader)
            except StopIteration:
                self._ended = End()
                raise
            arrays = self.emit(batch)
            self._state = self._loader.position()
            self._provenance = replace(batch, data={})
            return arrays
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self._loader, self.emit, self.prefetch)
            self._finalizer = weakref.finalize(self, self._prefetcher.stop)
        # Keep `prefetch` batches' transfers in flight: dispatched now, awaited by the step.
        while self._last is None and len(self._ahead) < self.prefetch:
            item = self._prefetcher.take()
            if isinstance(item, (End, Failure)):
                self._last = item
            else:
                self._ahead.append((self.emit.device(item[0]), item[1], item[2]))
        if not self._ahead:
            self._ended = self._last
            return self._next_arrays()
        arrays, self._state, self._provenance = self._ahead.popleft()
        return arrays

    @property
    def provenance(self) -> LocalBatch | None:
        """The last batch the caller received, without its data: `refs`, packed `segments`,
        `lanes`, `explain()` (None before the first batch)."""
        return self._provenance

    def explain(self) -> list[dict[str, Any]]:
        """Per row of this process's part of the last batch received: its global row, lane and
        the records (packed: document pieces) it holds — `LocalBatch.explain()`."""
        if self._provenance is None:
            raise PlanError("explain() describes the last batch received; take one first.")
        return self._provenance.explain()

    def _halt(self, closing: bool = False) -> None:
        """Stops the prefetch thread; what it built ahead is dropped (the state is the consumed one)."""
        if self._finalizer is not None and self._finalizer() is False:
            self._abandoned = True  # its thread is still inside the loader: leave the loader to it
        self._prefetcher = self._finalizer = None
        if self._abandoned and not closing:
            raise WorkerError("this JaxLoader's prefetch thread did not stop (blocked in a read) and "
                              "still runs its loader; build a new JaxLoader and restore its state there.")
        self._ahead.clear()
        self._last = None

    # --- state -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON state after the last batch the caller received (prefetched batches excluded).

        In a multi-process run each process's state holds its own lanes; for pipelines with a
        filter, `zephon.merge_states` them before resuming at another data-parallel degree.
        """
        return self._loader.state_from(copy.deepcopy(self._state))

    def restore(self, state: Mapping[str, Any], *, allow_batch_change: bool = False) -> None:
        """Continues from `state` (from any mesh or data-parallel degree of the same plan; with
        `allow_batch_change=True`, also one saved under another global batch size)."""
        self._halt()
        self._loader.restore(state, allow_batch_change=allow_batch_change)
        self._loader.settle_end()
        self._state = self._loader.position()
        self._ended = None

    get_state = state
    set_state = restore

    def close(self) -> None:
        """Stops the prefetch thread and releases the loader; safe to call twice."""
        self._halt(closing=True)
        if not self._abandoned:
            self._loader.close()
        if self._tel is not None:
            self._tel.close()
        self._ended = End()

    def __enter__(self) -> JaxLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _process_all_gather() -> Any:
    """`[ints] -> every process's [ints]` through `jax.distributed` (for a finite plan's end)."""
    import numpy as np
    from jax.experimental import multihost_utils

    def all_gather(values: list[int]) -> list[list[int]]:
        got = multihost_utils.process_allgather(np.asarray(values, np.int32))
        return np.asarray(got).reshape(-1, len(values)).tolist()

    return all_gather

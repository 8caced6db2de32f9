"""`TorchLoader`: an iterator of `{field: Tensor}` with `state_dict()` / `load_state_dict()`.

Parallelism comes from a Zephon runner; optional `DTensor` output over a device mesh.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, overload

import torch

from zephon.backends.doors import refuse
from zephon.backends.torch.batch import Emitter
from zephon.backends.torch.placement import all_gather_fn, data_parallel, mesh_data_parallel, to_dtensors
from zephon.backends.torch.state import state_document
from zephon.errors import PlanError
from zephon.exec.loader import Loader, LocalBatch
from zephon.pipeline import How, Pipeline, Where, no_rest, read_call
from zephon.plan import Batching
from zephon.sources.base import RecordSource
from zephon.telemetry import Stats
from zephon.telemetry import make as telemetry_recorder
from zephon.telemetry import require as require_telemetry

Sources = RecordSource | Sequence[RecordSource] | Mapping[int, RecordSource]


class TorchLoader:
    """Global batches as `{field: Tensor}` for a torch training loop, with resumable state.

    Args:
      pipeline: a `zephon.Pipeline(plan, sources, ops, per_source=, seed=)`: what is read.
      where: a `zephon.Where`: `rank`/`world` (default: `torch.distributed`'s, in `group`), or
        `mesh` (a `DeviceMesh`; fields are then `DTensor`s sharded on dim 0 over `batch_axes`,
        mesh dim names or indices, default every dim) from which rank and world follow;
        `lanes`, `all_gather` as for `zephon.Loader` (`all_gather` defaults to one through
        `torch.distributed` in `group`). `sharding` is JAX's and is refused.
      how: a `zephon.How`: `runner`, `read_ahead`, `micro_batches`, `domains` as for
        `zephon.Loader` (`close()` closes the runner); `telemetry` (True by default, False, or a
        `zephon.Telemetry(...)`) backs `stats()`: the caller's wait in `next()` (stall %), the
        loader's stages and the emit stage (tensors, casts, pinning, device transfer).
        `prefetch` means nothing here: batches are built when asked (use `ZephonDataLoader`'s
        workers, or a `threads`/`processes` runner, to work ahead).
      start_step: first global batch (random-access pipelines; others restore a state).
      dtypes, pin_memory, device: the `Emitter`'s casts (field -> torch dtype), page-locked
        memory, and device transfer.

    The old form `TorchLoader(plan, sources, transforms, seed=, rank=, world=, mesh=,
    mesh_dims=, runner=, ...)` works for this version with a `DeprecationWarning` naming the new
    one (`mesh_dims` is now `Where.batch_axes`).

    A finite plan ends at the same step on every rank (ranks agree through `torch.distributed`
    when its pipeline changes the number of records), `len()` is the steps left, and every
    `iter()` after the first starts the next epoch — the order `repeat()` gives its next pass —
    unless `set_epoch(e)` or `load_state_dict` chose where the next one starts.
    """

    @overload
    def __init__(self, pipeline: Pipeline, where: Where | None = None, how: How | None = None, *,
                 start_step: int = 0, dtypes: Mapping[str, Any] | None = None, pin_memory: bool = False,
                 device: str | torch.device | None = None) -> None: ...

    @overload  # deprecated: TorchLoader(plan, sources, transforms, seed=, rank=, world=, mesh_dims=, ...)
    def __init__(self, pipeline: Batching, where: Any, how: Sequence[Any] = (), *,
                 start_step: int = 0, dtypes: Mapping[str, Any] | None = None, pin_memory: bool = False,
                 device: str | torch.device | None = None, **old_form: Any) -> None: ...

    def __init__(self, pipeline: Pipeline | Batching | None = None, where: Any = None, how: Any = None, *,
                 start_step: int = 0, dtypes: Mapping[str, Any] | None = None, pin_memory: bool = False,
                 device: str | torch.device | None = None, **old_form: Any) -> None:
        call = read_call("zephon.backends.torch.TorchLoader", pipeline, where, how, old_form,
                         renames={"mesh_dims": "batch_axes"})
        no_rest("TorchLoader", call.rest)
        where, how = call.where, call.how
        #: the value this loader reads, and its two option groups
        self.pipeline, self.where, self.how = call.pipeline, where, how
        plan = call.pipeline.plan
        refuse("TorchLoader", where, ("sharding",), "a JAX sharding; torch takes Where(mesh=, batch_axes=) "
               "with a DeviceMesh, or Where(rank=, world=).")
        if where.mesh is not None:
            if plan.lanes.mapping != "contiguous":
                raise PlanError("DTensor output needs lanes(..., mapping='contiguous'): with "
                                "'interleaved' a rank's rows are not one contiguous block of dim 0.")
            rank, world = mesh_data_parallel(where.mesh, where.batch_axes)
        else:
            refuse("TorchLoader", where, ("batch_axes",), "batch axes split a mesh; pass Where(mesh=) too.")
            rank, world = data_parallel(where.rank, where.world, where.group)
        n = plan.num_steps
        self._tel = telemetry_recorder(how.telemetry, None if n is None else max(0, n - start_step))
        gather = where.all_gather if where.all_gather is not None else all_gather_fn(where.group)
        self.loader = Loader(call.pipeline,
                             replace(where, mesh=None, batch_axes=None, group=None, rank=rank, world=world,
                                     all_gather=gather),
                             replace(how, telemetry=self._tel is not None), start_step=start_step)
        if self._tel is not None and self.loader.telemetry is not None:
            self._tel.include(self.loader.telemetry)
        self.loader.settle_end()
        self._fresh = True  # the next iter() continues here instead of starting the next epoch
        self.emitter = Emitter.make(dtypes, pin_memory, device)
        self._mesh, self._batch_axes = where.mesh, where.batch_axes
        self._provenance: LocalBatch | None = None

    @property
    def rank(self) -> int:
        return self.loader.rank

    @property
    def world(self) -> int:
        return self.loader.world

    @property
    def step(self) -> int:
        """The next global batch this loader yields."""
        return self.loader.step

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def __len__(self) -> int:
        """Global batches left in this epoch of a finite plan (TypeError if it repeats forever)."""
        return len(self.loader)

    def __iter__(self) -> TorchLoader:
        if not self._fresh and self.loader.finite:
            self.set_epoch(self.loader.epoch + 1)
        self._fresh = False
        return self

    def set_epoch(self, epoch: int) -> None:
        """The next `iter()` starts pass `epoch` over the finite plan (torch's convention)."""
        self.loader.set_epoch(epoch)
        self.loader.settle_end()
        self._fresh = True

    def __next__(self) -> dict[str, Any]:
        self._fresh = False
        if self._tel is None:
            return self._next_tensors()
        return self._tel.step(self._next_tensors)

    def _next_tensors(self) -> dict[str, Any]:
        batch = next(self.loader)
        t0 = time.perf_counter()
        out = self.emitter(batch)
        self._provenance = replace(batch, data={})
        out = out if self._mesh is None else to_dtensors(out, self._mesh, self._batch_axes)
        if self._tel is not None:
            self._tel.add("emit", time.perf_counter() - t0)
        return out

    def stats(self) -> Stats:
        """Telemetry so far: stall %, stage times, rows/tokens/bytes (see `zephon.telemetry`)."""
        return require_telemetry(self._tel, "this TorchLoader").stats()

    @property
    def provenance(self) -> LocalBatch | None:
        """The last batch yielded, without its data: `refs`, packed `segments`, `lanes`,
        `explain()` (None before the first batch)."""
        return self._provenance

    def explain(self) -> list[dict[str, Any]]:
        """Per row of this rank's part of the last batch: its global row, lane and the records
        (packed: document pieces) it holds — `LocalBatch.explain()`."""
        if self._provenance is None:
            raise PlanError("explain() describes the last batch yielded; take one first.")
        return self._provenance.explain()

    def state_dict(self) -> dict[str, Any]:
        """The Zephon state after the last batch this loader yielded (see the module doc)."""
        return state_document(self.loader.state(), self.loader)

    def load_state_dict(self, state: Mapping[str, Any], *, allow_batch_change: bool = False) -> None:
        """Continues after the batches `state` had yielded (any emitter's state, saved at any
        data-parallel degree; merge every rank's with `zephon.merge_states` first).
        `allow_batch_change=True` accepts a state saved under another global batch size: every
        lane continues where it stopped (see `zephon.Loader.restore`)."""
        self.loader.restore(state, allow_batch_change=allow_batch_change)
        self.loader.settle_end()
        self._fresh = True

    def close(self) -> None:
        self.loader.close()
        if self._tel is not None:
            self._tel.close()

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

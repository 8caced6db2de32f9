"""`TorchLoader`: an iterator of `{field: Tensor}` with `state_dict()` / `load_state_dict()`.

Parallelism comes from a Zephon runner; optional `DTensor` output over a device mesh.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from zephon.backends.torch.batch import Emitter
from zephon.backends.torch.placement import MeshDims, all_gather_fn, data_parallel, mesh_data_parallel, to_dtensors
from zephon.backends.torch.state import state_document
from zephon.errors import PlanError
from zephon.exec.loader import Loader, LocalBatch
from zephon.ops.base import Operator
from zephon.plan import Batching
from zephon.runners.base import Runner
from zephon.sources.base import RecordSource
from zephon.telemetry import Stats
from zephon.telemetry import make as telemetry_recorder
from zephon.telemetry import require as require_telemetry

Sources = RecordSource | Sequence[RecordSource] | Mapping[int, RecordSource]


class TorchLoader:
    """Global batches as `{field: Tensor}` for a torch training loop, with resumable state.

    Args: as `zephon.Loader`, except that `rank`/`world` default to `torch.distributed`'s (in
    `group`), or come from `mesh` (then fields are `DTensor`s sharded on dim 0 over
    `mesh_dims`); plus the `Emitter` options `dtypes`, `pin_memory`, `device`. Other keyword
    arguments go to `zephon.Loader` (e.g. `read_ahead`). `close()` closes the runner.
    `telemetry` (True by default, False, or a `zephon.Telemetry(...)`) backs `stats()`: the
    caller's wait in `next()` (stall %), the loader's stages and the emit stage (tensors, casts,
    pinning, device transfer).

    A finite plan ends at the same step on every rank (ranks agree through `torch.distributed`
    when its pipeline changes the number of records), `len()` is the steps left, and every
    `iter()` after the first starts the next epoch — the order `repeat()` gives its next pass —
    unless `set_epoch(e)` or `load_state_dict` chose where the next one starts.
    """

    def __init__(self, plan: Batching, sources: Sources, transforms: Sequence[Operator] = (), *,
                 seed: int = 0, rank: int | None = None, world: int | None = None,
                 group: dist.ProcessGroup | None = None, mesh: Any = None, mesh_dims: MeshDims = None,
                 runner: Runner | None = None, start_step: int = 0, dtypes: Mapping[str, Any] | None = None,
                 pin_memory: bool = False, device: str | torch.device | None = None,
                 **loader_options: Any) -> None:
        if mesh is not None:
            if rank is not None or world is not None or group is not None:
                raise PlanError("pass either mesh or rank/world/group, not both: with a mesh the "
                                "rows a process loads must be the block its DTensor shard holds.")
            if plan.lanes.mapping != "contiguous":
                raise PlanError("DTensor output needs lanes(..., mapping='contiguous'): with "
                                "'interleaved' a rank's rows are not one contiguous block of dim 0.")
            rank, world = mesh_data_parallel(mesh, mesh_dims)
        else:
            rank, world = data_parallel(rank, world, group)
        loader_options.setdefault("all_gather", all_gather_fn(group))
        n = plan.num_steps
        self._tel = telemetry_recorder(loader_options.pop("telemetry", True),
                                       None if n is None else max(0, n - start_step))
        self.loader = Loader(plan, sources, transforms, seed=seed, rank=rank, world=world,
                             runner=runner, start_step=start_step, telemetry=self._tel is not None,
                             **loader_options)
        if self._tel is not None and self.loader.telemetry is not None:
            self._tel.include(self.loader.telemetry)
        self.loader.settle_end()
        self._fresh = True  # the next iter() continues here instead of starting the next epoch
        self.emitter = Emitter.make(dtypes, pin_memory, device)
        self._mesh, self._mesh_dims = mesh, mesh_dims
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
        out = out if self._mesh is None else to_dtensors(out, self._mesh, self._mesh_dims)
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

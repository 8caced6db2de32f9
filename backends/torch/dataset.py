"""`ZephonIterableDataset`: global batches as a torch `IterableDataset`, for `DataLoader`.

With `num_workers=W > 1` and a one-to-one pipeline, worker `w` computes steps `start+w,
start+w+W, ...`; DataLoader fetches from workers round-robin and returns results in order, so
the sequence is unchanged. Under `ZephonDataLoader` (`zephon.backends.torch.dataloader`) a
count-changing pipeline's workers each run a block of the rank's lanes and yield `WorkerPart`s.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from torch.utils.data import IterableDataset, get_worker_info

from zephon.backends.doors import refuse
from zephon.backends.torch.batch import Emitter
from zephon.backends.torch.placement import all_gather_fn, data_parallel
from zephon.backends.torch.state import seek_position, state_document
from zephon.errors import PlanError, StateError
from zephon.exec.loader import Loader
from zephon.exec.resize import check_micro_schedule
from zephon.pipeline import How, Pipeline, Where, no_rest, read_call
from zephon.plan import Batching
from zephon.runners.base import Runner


@dataclass
class WorkerPart:
    """What a DataLoader worker of `ZephonDataLoader` yields for a count-changing pipeline: its
    lanes' rows of global batch `step` and those lanes' position after it."""

    step: int
    worker: int
    lanes: list[int]
    data: dict[str, Any]
    position: dict[str, Any]

    def pin_memory(self) -> WorkerPart:
        return self  # pinned once, after the parts are concatenated (`ZephonDataLoader`)


class ZephonIterableDataset(IterableDataset):
    """Global batches as an `IterableDataset`, for `DataLoader(dataset, batch_size=None)`.

    Every `iter()` starts at the dataset's start position (`start_step`, or what `restore` set),
    so the dataset is re-iterable like any torch dataset; `ZephonDataLoader` moves that start as
    batches are consumed. Rank and world are fixed at construction, in the process that
    initialised `torch.distributed`, never in a worker.

    Pipelines that keep one output per input (random access by step): in DataLoader worker `w`
    of `W` the dataset yields steps `start+w, start+w+W, ...`, and DataLoader's in-order
    round-robin fetching returns exactly steps `start, start+1, ...`.

    Count-changing pipelines (filters, flat maps, packing) cannot be split by step: each lane
    advances sequentially. Under `ZephonDataLoader`, worker `w` of `W` runs a block of the lanes
    this rank owns instead (`worker_rank`) and yields its rows of every step with its lanes'
    position (`WorkerPart`); `ZephonDataLoader` joins the `W` parts of each step. A plain
    DataLoader cannot join them, so it gets such a pipeline with `num_workers <= 1` only.

    Keep `in_order=True` (the default) with workers.

    Args:
      pipeline: a `zephon.Pipeline(plan, sources, ops, per_source=, seed=)`: what is read.
      where: a `zephon.Where(rank=, world=, group=, all_gather=)`: rank and world default to
        `torch.distributed`'s (in `group`); fixed here, never in a worker. `mesh`, `batch_axes`,
        `sharding` and `lanes` are refused: a DataLoader's batches are plain tensors and its
        workers split the rank's lanes themselves.
      how: a `zephon.How`: `runner` runs inside whichever process iterates (each worker its
        own); `read_ahead`, `micro_batches` (checked against this rank's rows, not a worker's
        part), `domains` as for `zephon.Loader`; with `telemetry` on (the default) every batch
        carries its loader's stage times (`TorchBatch.telemetry`), which
        `ZephonDataLoader.stats()` sums over its workers, reporting as this `How.telemetry`
        asks (a `zephon.Telemetry(log_every=...)` too). `prefetch` means nothing here: a
        DataLoader's workers prefetch `prefetch_factor` batches each (`ZephonDataLoader`'s own
        argument, as in torch).
      start_step: first global batch (random-access pipelines; others restore a state).
      dtypes: field -> torch dtype casts of the `Emitter`.

    The old form `ZephonIterableDataset(plan, sources, transforms, seed=, rank=, world=,
    runner=, ...)` works for this version with a `DeprecationWarning` naming the new one.

    A finite plan's end (`len()`) is learnt in the main process, through `torch.distributed`
    when its pipeline changes the number of records, and handed to the loaders it starts.
    `start_epoch(e)` moves the start to step 0 of pass `e` (what `ZephonDataLoader` does).
    """

    @overload
    def __init__(self, pipeline: Pipeline, where: Where | None = None, how: How | None = None, *,
                 start_step: int = 0, dtypes: Mapping[str, Any] | None = None) -> None: ...

    @overload  # deprecated: ZephonIterableDataset(plan, sources, transforms, seed=, rank=, world=, ...)
    def __init__(self, pipeline: Batching, where: Any, how: Sequence[Any] = (), *,
                 start_step: int = 0, dtypes: Mapping[str, Any] | None = None, **old_form: Any) -> None: ...

    def __init__(self, pipeline: Pipeline | Batching | None = None, where: Any = None, how: Any = None, *,
                 start_step: int = 0, dtypes: Mapping[str, Any] | None = None, **old_form: Any) -> None:
        call = read_call("zephon.backends.torch.ZephonIterableDataset", pipeline, where, how, old_form)
        no_rest("ZephonIterableDataset", call.rest)
        where, how = call.where, call.how
        refuse("ZephonIterableDataset", where, ("mesh", "batch_axes", "sharding", "lanes"),
               "a DataLoader's batches are plain tensors of this rank's rows (Where(rank=, world=, "
               "group=)), and its workers split the rank's lanes themselves; for DTensors over a mesh "
               "use TorchLoader.")
        self.pipeline = call.pipeline
        self.plan, self.sources, self.transforms = self.pipeline.plan, self.pipeline.sources, self.pipeline.ops
        self._all_gather = where.all_gather or all_gather_fn(where.group)
        #: how ZephonDataLoader reports (a Telemetry recorder is not sent to workers: see __getstate__)
        self.telemetry_config = how.telemetry
        self.telemetry = bool(how.telemetry)  # per-process recorders
        self._end: int | None = None  # the plan's end in the start's epoch, once known
        self.runner = how.runner
        self.rank, self.world = data_parallel(where.rank, where.world, where.group)
        if how.micro_batches is not None:  # this rank's rows, not a worker's part
            check_micro_schedule(self.plan, how.micro_batches, self.world)
        #: what every loader this dataset starts gets (rank, world, runner and end are per loader)
        self.how = dataclasses.replace(how, runner=None, telemetry=self.telemetry, micro_batches=None)
        self.where = Where(rank=self.rank, world=self.world)
        self.seed = self.pipeline.seed
        self.emitter = Emitter.make(dtypes)
        main = self._loader(start_step, main=True)
        self.one_to_one = main.random_access
        self._main: Loader | None = main  # builds states and checks restores; never iterated
        self._start: dict[str, Any] = main.position()
        self._live: Loader | None = None  # the main-process loader of the newest iter()
        self._parts = False  # set in the workers of a ZephonDataLoader (count-changing pipelines)
        self.settle()

    def _loader(self, start_step: int = 0, runner: Runner | None = None, rank: int | None = None,
                world: int | None = None, main: bool = False) -> Loader:
        """A loader at `start_step`; only iterating ones get the runner (closing a loader closes it);
        the main one agrees on the plan's end with the other ranks, the others are told it."""
        where = Where(rank=self.rank if rank is None else rank, world=self.world if world is None else world,
                      all_gather=self._all_gather if main else None)
        return Loader(self.pipeline, where, dataclasses.replace(self.how, runner=runner),
                      start_step=start_step, epoch=self.epoch, end=None if main else self._end)

    def _emit(self, loader: Loader, batch: Any, worker: int) -> Any:
        """The batch as tensors; with telemetry, timed and carrying this process's stage times."""
        tel = loader.telemetry
        if tel is None:
            return self.emitter(batch)
        out = tel.timed("emit", self.emitter, batch)
        out.telemetry = (worker, *tel.snapshot())
        return out

    def _main_loader(self) -> Loader:
        if self._main is None:
            self._main = self._loader(main=True)
        return self._main

    def __getstate__(self) -> dict[str, Any]:
        # live loaders hold generators, and workers build their own; they are told the end
        return {**self.__dict__, "_live": None, "_main": None, "_all_gather": None, "telemetry_config": None}

    @property
    def start_step(self) -> int:
        return int(self._start["step"])

    @property
    def epoch(self) -> int:
        """The pass over a finite plan that iterations start in."""
        start = getattr(self, "_start", None)
        return int(start.get("epoch", 0)) if start else 0

    @property
    def finite(self) -> bool:
        return self._main_loader().finite

    def settle(self, workers: bool = False) -> None:
        """Learns the plan's end in the start's epoch where loaders need it told: ranks of
        world > 1 agree on it (every rank calls this), and DataLoader workers, each with a part
        of the lanes, get it from here (`workers=True` counts it if no one has)."""
        main = self._main_loader()
        if main.epoch != self.epoch:
            main.set_epoch(self.epoch)
        main.settle_end()
        if workers and main.finite and not main.random_access:
            main.end_step()
        self._end = main.end_if_known()

    def start_epoch(self, epoch: int) -> None:
        """Future iterations start at step 0 of pass `epoch` over the finite plan."""
        main = self._main_loader()
        main.set_epoch(epoch)
        self._start = main.position()
        self._end = None
        self.settle()

    def worker_rank(self, worker: int, workers: int) -> tuple[int, int]:
        """(rank, world) of a Loader over worker `worker`'s block of this rank's lanes.

        The rank's lanes split into `workers` equal blocks; with the plan's lane mapping each is
        the lanes of a rank at degree `world × workers`: contiguous blocks for a contiguous
        mapping, every `workers`-th owned lane for an interleaved one.
        """
        lanes = self.plan.lanes
        owned = lanes.count // self.world
        if workers < 1 or owned % workers:
            fits = [w for w in range(1, owned + 1) if owned % w == 0]
            raise PlanError(
                f"num_workers={workers} cannot split the {owned} lanes rank {self.rank} owns "
                f"(lanes={lanes.count}, world={self.world}) evenly, and a pipeline that changes "
                "the number of records splits its work among DataLoader workers by lanes. Use "
                f"num_workers in {fits} (or 0), or a plan whose lane count is a multiple of "
                f"world x num_workers (lanes={math.lcm(lanes.count, self.world * max(1, workers))}; "
                "another lane count is another plan: its batches differ).")
        if lanes.mapping == "contiguous":
            return self.rank * workers + worker, self.world * workers
        return self.rank + worker * self.world, self.world * workers

    def restore(self, state: Mapping[str, Any], *, allow_batch_change: bool = False) -> None:
        """Future iterations start after the batches `state` had yielded: a state of any
        emitter (`state_dict()`, `Loader.state()`, ...) saved at any data-parallel degree
        (and, with `allow_batch_change=True`, under another global batch size)."""
        main = self._main_loader()
        main.restore(state, allow_batch_change=allow_batch_change)  # checks plan, seed, pipeline and lanes
        self._start = main.position()
        self._end = None
        self.settle()

    def continue_from(self, position: Mapping[str, Any]) -> None:
        """Future iterations start at `position` (a position this job's loaders reported)."""
        epoch = self.epoch
        self._start = copy.deepcopy(dict(position))
        if self.epoch != epoch:
            self._end = None
            self.settle()

    def state_from(self, position: Mapping[str, Any]) -> dict[str, Any]:
        """The state document (torch's `state_dict()` form) at `position`."""
        main = self._main_loader()
        return state_document(main.state_from(position), main)

    def position_after(self, consumed: int) -> dict[str, Any]:
        """Position after `consumed` batches of the newest iteration (in this process)."""
        if consumed == 0:
            return self._start
        target = self.start_step + consumed
        if self.one_to_one:
            main = self._main_loader()
            main.seek(target)
            return main.position()
        live = self._live
        if live is None or live.step != target:
            raise StateError(f"the position after {consumed} batches of a pipeline that changes the "
                             "number of records is known only to the loaders that produced them; "
                             "iterate with ZephonDataLoader, which collects it from its workers.")
        return copy.deepcopy(live.position())

    def state_after(self, consumed: int) -> dict[str, Any]:
        """State after `consumed` batches of the newest iteration (torch's `state_dict()` form)."""
        return self.state_from(self.position_after(consumed))

    def __len__(self) -> int:
        """Batches left from the start state in its epoch (finite plans only)."""
        main = self._main_loader()
        main.seek_position(self._start)  # its epoch, and a run resumed at another batch size
        n = main.end_step()
        if n is None:
            raise TypeError("this Zephon dataset has no length: its plan repeats forever.")
        return max(0, n - self.start_step)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self._parts and not self.one_to_one:
            yield from self._iter_parts(worker, workers)
            return
        loader = self._loader(runner=self.runner)
        seek_position(loader, self._start)
        if workers == 1:
            if info is None:
                self._live = loader
            for batch in loader:
                yield self._emit(loader, batch, worker)
            return
        if not self.one_to_one:
            raise PlanError(f"this pipeline changes the number of records, so its lanes advance "
                            f"sequentially and {workers} DataLoader workers cannot split it by step; "
                            "use ZephonDataLoader (its workers split the lanes and it joins their "
                            "rows), or num_workers=0 or 1.")
        for batch in loader.strided(loader.step + worker, workers):
            yield self._emit(loader, batch, worker)

    def _iter_parts(self, worker: int, workers: int) -> Iterator[WorkerPart]:
        rank, world = self.worker_rank(worker, workers)
        loader = self._loader(runner=self.runner, rank=rank, world=world)
        seek_position(loader, self._start)
        lanes = [int(l) for l in loader.owned]
        for batch in loader:
            # a copy: the part is pickled later, by the queue's feeder thread
            yield WorkerPart(batch.step, worker, lanes, self._emit(loader, batch, worker),
                             copy.deepcopy(loader.position()))

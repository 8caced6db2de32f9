"""The PyTorch emitter: global batches as `torch.Tensor`s, a DataLoader dataset, resumable state.

Each process materialises only the rows of the lanes it owns; this module hands those numpy rows
to torch *without copying* (`torch.from_numpy`), so the torch path costs what the numpy reference
costs. Copies happen only where they are unavoidable and asked for: a dtype cast (`dtypes=`, e.g.
bfloat16, which numpy lacks), pinning (`pin_memory=True`) and a device transfer (`device=`).

Which rows a process gets is decided by the plan's lanes, never by torch: the data-parallel rank
and degree come from `torch.distributed` (or a `DeviceMesh`), so every DDP rank holds exactly
global rows `[r*B/D, (r+1)*B/D)` and the concatenation over ranks is the numpy reference's global
batch for every degree `D` dividing the lane count.

Three ways to iterate, from simplest to most torch-shaped:

- `TorchLoader`: an iterator of `{field: Tensor}` with `state_dict()` / `load_state_dict()`.
  Parallelism comes from a Zephon runner; optional `DTensor` output over a device mesh.
- `ZephonIterableDataset`: an `IterableDataset` for `DataLoader(batch_size=None)`. With
  `num_workers=W > 1` and a one-to-one pipeline, worker `w` computes steps `start+w,
  start+w+W, ...`; DataLoader fetches from workers round-robin and returns results in order, so
  the sequence is unchanged.
- `ZephonDataLoader`: that DataLoader with the StatefulDataLoader convention: it counts the
  batches it *handed to the training loop* (not those prefetched by workers), so its
  `state_dict()` resumes exactly after the last batch the model saw. Its workers also run
  pipelines that change the number of records (filters, packing): each takes a block of the
  rank's lanes, and the loader joins their rows of every step and merges their lanes' positions.

Fields torch cannot hold (bytes, strings, ragged lists: numpy object arrays, and datetimes) are
passed through unchanged as numpy arrays; asking to cast one raises `PlanError`.

Batches are `TorchBatch`es (dicts) with `micro_batches(n)` for gradient accumulation: `n` equal,
consecutive blocks of this rank's rows (views; a `DTensor` is cut in its local shard), whose
concatenation is the batch, so changing `n` — also at a resume — changes nothing loaded.

State: `state_dict()` is Zephon's state document itself — the dict `Loader.state()` returns, of
plain dicts, lists, strings and numbers — so `torch.save` / `torch.load(weights_only=True)` need
no pickle, every emitter restores it (`Loader.restore`, `JaxLoader.restore`, ...) and
`load_state_dict` restores theirs. Each rank's `lanes` are its own, the rest is identical on
every rank: `zephon.merge_states` of every rank's state resumes at any other degree, and so does a
`torch.distributed.checkpoint` loaded with a fresh loader's `state_dict()` as the template (each
rank asks for the lanes it now owns). States are built only when asked for: loaders keep cheap
positions, so a pipeline of lambdas iterates with workers and is refused only by `state_dict()`.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from zephon.errors import PlanError, StateError
from zephon.exec.loader import Loader, LocalBatch
from zephon.plan import Batch
from zephon.sources.base import RecordSource
from zephon.ops.base import Transform

log = logging.getLogger(__name__)

Sources = RecordSource | Sequence[RecordSource] | Mapping[int, RecordSource]
MeshDims = str | int | Sequence[str | int] | None

# numpy dtypes torch.from_numpy accepts; anything else is passed through as numpy.
_TENSOR_DTYPES = frozenset(np.dtype(d) for d in (
    np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128))


# --- emitting -----------------------------------------------------------------------------------
class TorchBatch(dict):
    """`{field: Tensor}` (numpy arrays for fields torch cannot hold) with `micro_batches(n)`."""

    def micro_batches(self, n: int) -> list["TorchBatch"]:
        """`n` micro-batches (see `micro_batches`)."""
        return micro_batches(self, n)


def _rows_of(v: Any) -> int:
    from torch.distributed.tensor import DTensor

    return int(v.to_local().shape[0] if isinstance(v, DTensor) else v.shape[0])


def _cut_rows(v: Any, start: int, stop: int) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):  # cut the local shard: each rank's i-th block, no communication
        local = v.to_local()[start:stop]
        rows = v.shape[0] * (stop - start) // max(1, _rows_of(v))
        shape = torch.Size((rows, *v.shape[1:]))
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(local, v.device_mesh, v.placements, run_check=False, shape=shape,
                                  stride=stride)
    return v[start:stop]


def micro_batches(batch: Mapping[str, Any], n: int) -> list[TorchBatch]:
    """`n` micro-batches of this rank's rows: equal, consecutive blocks (views, no copy).

    Micro-batch `i` holds rows `[i*R/n, (i+1)*R/n)` of the `R` rows this rank holds (of each
    `DTensor`'s local shard), so `torch.cat` of the micro-batches is the batch for every `n`.
    """
    from zephon.backends.numpy import check_micro_count

    rows = {_rows_of(v) for v in batch.values()}
    if len(rows) > 1:
        raise PlanError(f"the batch's fields have different row counts {sorted(rows)}; micro-batches "
                        "cut every field at the same rows.")
    n = check_micro_count(n, rows.pop() if rows else 0)
    m = (_rows_of(next(iter(batch.values()))) // n) if batch else 0
    return [TorchBatch({k: _cut_rows(v, i * m, (i + 1) * m) for k, v in batch.items()}) for i in range(n)]


def torch_dtype(dtype: Any) -> torch.dtype:
    """A `torch.dtype` from a dtype or its name ("bfloat16"), so configs can stay JSON."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise PlanError(f"{dtype!r} is not a torch dtype; use e.g. torch.bfloat16 or 'bfloat16'.")
    return found


def to_tensor(array: np.ndarray) -> torch.Tensor | np.ndarray:
    """A tensor sharing memory with `array`, or `array` itself if torch cannot hold its dtype.

    Copies only when torch could not safely share the memory: a read-only array (torch would
    warn and writes would be undefined), a non-contiguous one, or a non-native byte order.
    """
    arr = np.asarray(array)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.dtype not in _TENSOR_DTYPES:
        return arr
    if not (arr.flags.c_contiguous and arr.flags.writeable):
        arr = np.array(arr, order="C", copy=True)
    return torch.from_numpy(arr)


def _no_cast(np_dtype: np.dtype, dtype: Any) -> PlanError:
    return PlanError(f"a field of dtype {np_dtype} (bytes, text or ragged values) cannot become a "
                     f"torch tensor, so it cannot be cast to {dtype}; it is passed through as a "
                     "numpy array. Drop it from dtypes, or map it to fixed-size numbers (tokenize, "
                     "pad) in a transform first.")


@functools.lru_cache(maxsize=1)
def _can_pin() -> bool:
    """Whether page-locked memory exists here (it needs an accelerator runtime)."""
    try:
        torch.empty(1).pin_memory()
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class Emitter:
    """Turns a `LocalBatch` into `{field: Tensor}`: zero-copy, then cast, pin, transfer.

    `dtypes` maps field -> torch dtype (a cast, e.g. float32 -> bfloat16 rounds to nearest even).
    `pin_memory` is ignored with a warning where no accelerator exists, as DataLoader does.
    A transfer is non-blocking when the source is pinned; to the CPU it is a no-op (no copy).
    """

    dtypes: Mapping[str, Any] = field(default_factory=dict)
    pin_memory: bool = False
    device: torch.device | None = None

    @staticmethod
    def make(dtypes: Mapping[str, Any] | None = None, pin_memory: bool = False,
             device: str | torch.device | None = None) -> "Emitter":
        casts = {str(k): torch_dtype(v) for k, v in (dtypes or {}).items()}
        pin = bool(pin_memory) and _can_pin()
        if pin_memory and not pin:
            log.warning("pin_memory=True but no accelerator is available here; tensors are not "
                        "pinned (values are unchanged).")
        return Emitter(casts, pin, None if device is None else torch.device(device))

    def __call__(self, batch: LocalBatch) -> TorchBatch:
        unknown = sorted(set(self.dtypes) - set(batch.data))
        if unknown:
            raise PlanError(f"dtypes names fields {unknown} that the batch lacks; its fields are "
                            f"{sorted(batch.data)}.")
        return TorchBatch({k: self._one(v, self.dtypes.get(k)) for k, v in batch.data.items()})

    def _one(self, array: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor | np.ndarray:
        t = to_tensor(array)
        if not isinstance(t, torch.Tensor):
            if dtype is not None:
                raise _no_cast(t.dtype, dtype)
            return t
        if self.pin_memory:  # cast straight into pinned memory: one copy, not two
            t = torch.empty(t.shape, dtype=t.dtype if dtype is None else dtype, pin_memory=True).copy_(t)
        elif dtype is not None:
            t = t.to(dtype)
        if self.device is not None:
            t = t.to(self.device, non_blocking=self.pin_memory)
        return t


def emit(batch: LocalBatch, *, dtypes: Mapping[str, Any] | None = None, pin_memory: bool = False,
         device: str | torch.device | None = None) -> TorchBatch:
    """This process's rows of a global batch as tensors (see `Emitter`)."""
    return Emitter.make(dtypes, pin_memory, device)(batch)


# --- data-parallel placement --------------------------------------------------------------------
def data_parallel(rank: int | None = None, world: int | None = None,
                  group: "dist.ProcessGroup | None" = None) -> tuple[int, int]:
    """(rank, world) given, else from `torch.distributed` (in `group`), else (0, 1).

    Pass them explicitly when the data-parallel group is not the default one, e.g. with tensor
    parallelism where several global ranks share one row block.
    """
    if (rank is None) != (world is None):
        raise PlanError(f"pass both rank and world or neither (got rank={rank}, world={world}); "
                        "with neither they come from torch.distributed.")
    if rank is not None:
        return int(rank), int(world)  # type: ignore[arg-type]
    if dist.is_available() and dist.is_initialized():
        r, w = dist.get_rank(group), dist.get_world_size(group)
        if r < 0:
            raise PlanError("this process is not a member of the given process group; pass the "
                            "data-parallel group this rank belongs to.")
        return r, w
    if group is not None:
        raise PlanError("a process group was given but torch.distributed is not initialised; "
                        "call dist.init_process_group first.")
    return 0, 1


def _mesh_dims(mesh: Any, mesh_dims: MeshDims) -> list[int]:
    """Mesh dims the batch is split over, as indices in mesh order."""
    if mesh_dims is None:
        return list(range(mesh.ndim))
    names = list(mesh.mesh_dim_names or ())
    out = []
    for d in ([mesh_dims] if isinstance(mesh_dims, (str, int)) else mesh_dims):
        if isinstance(d, str):
            if d not in names:
                raise PlanError(f"mesh has no dim named {d!r}; its dims are {names}.")
            d = names.index(d)
        if not 0 <= int(d) < mesh.ndim:
            raise PlanError(f"mesh dim {d} is out of range for a {mesh.ndim}-d mesh.")
        out.append(int(d))
    if not out:
        raise PlanError("mesh_dims is empty; name the mesh dims the batch is split over.")
    return sorted(set(out))


def mesh_data_parallel(mesh: Any, mesh_dims: MeshDims = None) -> tuple[int, int]:
    """(rank, world) of this process's row block when the batch is split over `mesh_dims`.

    Rows are split over the dims in mesh order, as DTensor's `Shard(0)` placements split them,
    so rank = this process's coordinate on those dims, flattened row-major. Processes that differ
    only on other dims (replicas) share a rank and load the same rows.
    """
    dims = _mesh_dims(mesh, mesh_dims)
    coord = mesh.get_coordinate()
    if coord is None:
        raise PlanError("this process is not part of the device mesh; build the loader on the "
                        "mesh's ranks only.")
    sizes = [mesh.size(d) for d in dims]
    return int(np.ravel_multi_index([coord[d] for d in dims], sizes)), math.prod(sizes)


def to_dtensors(tensors: Mapping[str, Any], mesh: Any, mesh_dims: MeshDims = None) -> TorchBatch:
    """Wraps local row blocks as `DTensor`s sharded on dim 0 over `mesh_dims` (others replicate).

    Precondition (which `TorchLoader(mesh=...)` guarantees): the rows were loaded with the rank
    and world of `mesh_data_parallel(mesh, mesh_dims)` from a plan with contiguous lane mapping,
    so every process holds one equal, contiguous block. No communication: shapes are known.
    Pass-through (non-tensor) fields stay local numpy arrays.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dims = _mesh_dims(mesh, mesh_dims)
    placements = [Shard(0) if d in dims else Replicate() for d in range(mesh.ndim)]
    world = math.prod(mesh.size(d) for d in dims)
    out: dict[str, Any] = {}
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            out[k] = t
            continue
        shape = torch.Size((t.shape[0] * world, *t.shape[1:]))
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        out[k] = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
    return TorchBatch(out)


# --- state ------------------------------------------------------------------------------------
def state_document(state: Mapping[str, Any], loader: Loader) -> dict[str, Any]:
    """An independent copy of `loader`'s state document (plain dicts, lists, str, int, ...).

    With an accumulator (packing) every lane names its `held` inputs and `carry`, empty or not
    (the core writes both): a `torch.distributed.checkpoint` load fills only the keys of its
    template (a fresh loader's state), so a carry whose structure the template lacks is a loud
    "missing key", never a dropped carry (see the README).
    """
    return copy.deepcopy(dict(state))


def seek_position(loader: Loader, position: Mapping[str, Any]) -> None:
    """Puts `loader` at a `position()` taken in this job (see `Loader.seek_position`)."""
    loader.seek_position(position)


# --- iteration ----------------------------------------------------------------------------------
class TorchLoader:
    """Global batches as `{field: Tensor}` for a torch training loop, with resumable state.

    Args: as `zephon.Loader`, except that `rank`/`world` default to `torch.distributed`'s (in
    `group`), or come from `mesh` (then fields are `DTensor`s sharded on dim 0 over
    `mesh_dims`); plus the `Emitter` options `dtypes`, `pin_memory`, `device`. Other keyword
    arguments go to `zephon.Loader` (e.g. `read_ahead`). `close()` closes the runner.
    """

    def __init__(self, plan: Batch, sources: Sources, transforms: Sequence[Transform] = (), *,
                 seed: int = 0, rank: int | None = None, world: int | None = None,
                 group: "dist.ProcessGroup | None" = None, mesh: Any = None, mesh_dims: MeshDims = None,
                 runner: Any = None, start_step: int = 0, dtypes: Mapping[str, Any] | None = None,
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
        self.loader = Loader(plan, sources, transforms, seed=seed, rank=rank, world=world,
                             runner=runner, start_step=start_step, **loader_options)
        self.emitter = Emitter.make(dtypes, pin_memory, device)
        self._mesh, self._mesh_dims = mesh, mesh_dims

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

    def __iter__(self) -> "TorchLoader":
        return self

    def __next__(self) -> dict[str, Any]:
        out = self.emitter(next(self.loader))
        return out if self._mesh is None else to_dtensors(out, self._mesh, self._mesh_dims)

    def state_dict(self) -> dict[str, Any]:
        """The Zephon state after the last batch this loader yielded (see the module doc)."""
        return state_document(self.loader.state(), self.loader)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues after the batches `state` had yielded (any emitter's state, saved at any
        data-parallel degree; merge every rank's with `zephon.merge_states` first)."""
        self.loader.restore(state)

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> "TorchLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class WorkerPart:
    """What a DataLoader worker of `ZephonDataLoader` yields for a count-changing pipeline: its
    lanes' rows of global batch `step` and those lanes' position after it."""

    step: int
    worker: int
    lanes: list[int]
    data: dict[str, Any]
    position: dict[str, Any]

    def pin_memory(self) -> "WorkerPart":
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

    Keep `in_order=True` (the default) with workers. A `runner` runs inside whichever process
    iterates; other keyword arguments go to `zephon.Loader`.
    """

    def __init__(self, plan: Batch, sources: Sources, transforms: Sequence[Transform] = (), *,
                 seed: int = 0, rank: int | None = None, world: int | None = None,
                 group: "dist.ProcessGroup | None" = None, runner: Any = None, start_step: int = 0,
                 dtypes: Mapping[str, Any] | None = None, **loader_options: Any) -> None:
        self.plan, self.sources, self.transforms = plan, sources, tuple(transforms)
        self.loader_options = loader_options
        self.seed, self.runner = int(seed), runner
        self.rank, self.world = data_parallel(rank, world, group)
        self.emitter = Emitter.make(dtypes)
        main = self._loader(start_step)
        self.one_to_one = main.random_access
        self._main: Loader | None = main  # builds states and checks restores; never iterated
        self._start: dict[str, Any] = main.position()
        self._live: Loader | None = None  # the main-process loader of the newest iter()
        self._parts = False  # set in the workers of a ZephonDataLoader (count-changing pipelines)

    def _loader(self, start_step: int = 0, runner: Any = None, rank: int | None = None,
                world: int | None = None) -> Loader:
        """A loader at `start_step`; only iterating ones get the runner (closing a loader closes it)."""
        return Loader(self.plan, self.sources, self.transforms, seed=self.seed,
                      rank=self.rank if rank is None else rank, world=self.world if world is None else world,
                      runner=runner, start_step=start_step, **self.loader_options)

    def _main_loader(self) -> Loader:
        if self._main is None:
            self._main = self._loader()
        return self._main

    def __getstate__(self) -> dict[str, Any]:
        # live loaders hold generators, and workers build their own
        return {**self.__dict__, "_live": None, "_main": None}

    @property
    def start_step(self) -> int:
        return int(self._start["step"])

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

    def restore(self, state: Mapping[str, Any]) -> None:
        """Future iterations start after the batches `state` had yielded: a state of any
        emitter (`state_dict()`, `Loader.state()`, ...) saved at any data-parallel degree."""
        main = self._main_loader()
        main.restore(state)  # checks plan, seed, pipeline and lanes
        self._start = main.position()

    def continue_from(self, position: Mapping[str, Any]) -> None:
        """Future iterations start at `position` (a position this job's loaders reported)."""
        self._start = copy.deepcopy(dict(position))

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
        """Batches left from the start state (only for finite plans of one-to-one pipelines)."""
        n = self.plan.num_steps
        if n is None or not self.one_to_one:
            raise TypeError("this Zephon dataset has no length: its plan repeats forever or its "
                            "pipeline changes the number of records.")
        return max(0, n - self.start_step)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers = 1 if info is None else info.num_workers
        if self._parts and not self.one_to_one:
            yield from self._iter_parts(info.id, workers)
            return
        loader = self._loader(runner=self.runner)
        seek_position(loader, self._start)
        if workers == 1:
            if info is None:
                self._live = loader
            for batch in loader:
                yield self.emitter(batch)
            return
        if not self.one_to_one:
            raise PlanError(f"this pipeline changes the number of records, so its lanes advance "
                            f"sequentially and {workers} DataLoader workers cannot split it by step; "
                            "use ZephonDataLoader (its workers split the lanes and it joins their "
                            "rows), or num_workers=0 or 1.")
        for batch in loader.strided(loader.step + info.id, workers):
            yield self.emitter(batch)

    def _iter_parts(self, worker: int, workers: int) -> Iterator[WorkerPart]:
        rank, world = self.worker_rank(worker, workers)
        loader = self._loader(runner=self.runner, rank=rank, world=world)
        seek_position(loader, self._start)
        lanes = [int(l) for l in loader.owned]
        for batch in loader:
            # a copy: the part is pickled later, by the queue's feeder thread
            yield WorkerPart(batch.step, worker, lanes, self.emitter(batch),
                             copy.deepcopy(loader.position()))


class _MarkParts:
    """worker_init_fn of a ZephonDataLoader: makes the worker's dataset copy yield `WorkerPart`s,
    then calls the user's worker_init_fn. Module-level, so spawned workers can unpickle it."""

    def __init__(self, user_fn: Any = None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        get_worker_info().dataset._parts = True
        if self.user_fn is not None:
            self.user_fn(worker_id)


def join_parts(parts: Sequence[WorkerPart], per_lane: int, pin: bool = False) -> TorchBatch:
    """The rows of all parts, in lane order (one concatenation per field)."""
    if len(parts) == 1 and not pin:
        return TorchBatch(parts[0].data)
    lanes = np.concatenate([np.asarray(p.lanes, np.int64) for p in parts])
    order = np.argsort(lanes, kind="stable")
    rows = None
    if np.any(order != np.arange(len(order))):  # an interleaved mapping: workers hold every W-th lane
        rows = (order[:, None] * per_lane + np.arange(per_lane)).ravel()
    out: dict[str, Any] = {}
    for k in parts[0].data:
        vs = [p.data[k] for p in parts]
        if isinstance(vs[0], torch.Tensor):
            shape = (sum(v.shape[0] for v in vs),) + tuple(vs[0].shape[1:])
            joined = torch.empty(shape, dtype=vs[0].dtype, pin_memory=pin and rows is None)
            torch.cat(vs, out=joined)
            if rows is not None:
                joined = joined[torch.from_numpy(rows)]
                if pin:
                    joined = joined.pin_memory()
        else:
            joined = np.concatenate(vs)
            if rows is not None:
                joined = joined[rows]
        out[k] = joined
    return TorchBatch(out)


class ZephonDataLoader(DataLoader):
    """A `DataLoader` over a `ZephonIterableDataset` with StatefulDataLoader-style state.

    `state_dict()` describes the batches handed to the training loop, not those workers have
    prefetched; `load_state_dict()` makes the next `iter()` continue from there. Iterating again
    continues where the last iteration stopped: a Zephon plan spans all epochs (use
    `.repeat(epochs)`; each epoch is reshuffled), so the loader is a cursor over global steps.

    With `num_workers=W > 0`, a one-to-one pipeline is split by step (worker w computes steps
    `start+w, start+w+W, ...`); a count-changing one (filter, flat map, packing) by lanes: worker
    w runs the w-th of W equal blocks of this rank's lanes (W must divide them) and reports their
    position with its rows; this loader joins the W parts of each step in lane order and keeps
    the merged position of the last batch it handed out. The batches are the same for every W.

    Batch-shaping options (`batch_size`, `sampler`, `collate_fn`, ...) do not exist: the plan
    decides batches. Workers are never persistent, so each `iter()` starts them at the cursor,
    and results stay in order.
    """

    def __init__(self, dataset: ZephonIterableDataset, *, num_workers: int = 0,
                 pin_memory: bool = False, timeout: float = 0, worker_init_fn: Any = None,
                 multiprocessing_context: Any = None, prefetch_factor: int | None = None) -> None:
        if not isinstance(dataset, ZephonIterableDataset):
            raise PlanError(f"ZephonDataLoader needs a ZephonIterableDataset, got "
                            f"{type(dataset).__name__}; wrap your plan and sources in one.")
        parts = num_workers > 0 and not dataset.one_to_one
        if parts:
            dataset.worker_rank(0, num_workers)  # refuses a lane count the workers cannot split
            worker_init_fn = _MarkParts(worker_init_fn)
        super().__init__(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                         timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context,
                         prefetch_factor=prefetch_factor, persistent_workers=False, in_order=True)
        self._joins_parts = parts
        self._consumed = 0  # batches handed out by the newest iteration (one-to-one, or in-process)
        self._position: dict[str, Any] | None = None  # after the last joined batch (parts)
        self._generation = 0

    def _current(self) -> dict[str, Any]:
        """Position after the last batch handed out."""
        if self._position is not None:
            return self._position
        return self.dataset.position_after(self._consumed)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        ds: ZephonIterableDataset = self.dataset  # type: ignore[assignment]
        if self._consumed or self._position is not None:
            ds.continue_from(self._current())
            self._consumed, self._position = 0, None
        if ds.one_to_one and ds.plan.num_steps is not None and len(ds) == 0:
            log.warning("ZephonDataLoader is at the end of its plan (%d global batches): nothing "
                        "is left to yield. Build the plan with .repeat(epochs) to train longer, or "
                        "load_state_dict() an earlier state to replay.", ds.plan.num_steps)
        self._generation += 1
        if self._joins_parts:
            return self._joined(super().__iter__(), self._generation, ds.start_step)
        return self._counted(super().__iter__(), self._generation)

    def _superseded(self, generation: int) -> None:
        if generation != self._generation:
            raise StateError("this ZephonDataLoader iterator was superseded by a newer iter() or "
                             "load_state_dict(); state_dict() follows the newest one only, so "
                             "consume one iterator at a time.")

    def _counted(self, batches: Iterator[dict[str, Any]], generation: int) -> Iterator[dict[str, Any]]:
        for batch in batches:
            self._superseded(generation)
            self._consumed += 1
            yield batch

    def _joined(self, parts: Iterator[WorkerPart], generation: int, step: int) -> Iterator[dict[str, Any]]:
        workers = self.num_workers
        pin = self.pin_memory and _can_pin()
        per_lane = self.dataset.plan.per_lane  # type: ignore[attr-defined]
        while True:
            group: list[WorkerPart] = []
            for w in range(workers):
                part = next(parts, None)
                if part is None or part.step != step or part.worker != w:
                    # the plan ended: a worker whose lanes ran out stopped, and DataLoader goes
                    # on with the others; the step is incomplete, as it is for one loader
                    return
                group.append(part)
            self._superseded(generation)
            batch = join_parts(group, per_lane, pin)
            self._position = {"step": step + 1,
                              "lanes": {k: v for p in group for k, v in p.position["lanes"].items()}}
            step += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The Zephon state after the last batch handed out (see the module doc)."""
        return self.dataset.state_from(self._current())  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next `iter()` continues after the batches `state` had handed out (a state of any
        emitter, saved at any data-parallel degree; merge every rank's with `merge_states`)."""
        self.dataset.restore(state)  # type: ignore[attr-defined]
        self._consumed, self._position = 0, None
        self._generation += 1

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
  `num_workers=W > 1`, worker `w` computes steps `start+w, start+w+W, ...`; DataLoader fetches
  from workers round-robin and returns results in order, so the sequence is unchanged.
- `ZephonDataLoader`: that DataLoader with the StatefulDataLoader convention: it counts the
  batches it *handed to the training loop* (not those prefetched by workers), so its
  `state_dict()` resumes exactly after the last batch the model saw.

Fields torch cannot hold (bytes, strings, ragged lists: numpy object arrays, and datetimes) are
passed through unchanged as numpy arrays; asking to cast one raises `PlanError`.

State is Zephon's JSON state with the plan and every lane's state encoded as JSON strings: plain
str/int/list/dict, so `torch.save` / `torch.load(weights_only=True)` need no pickle, and
`torch.distributed.checkpoint` sees one opaque leaf per lane. Each rank's keys are its own lanes,
the rest is identical on every rank, so a checkpoint written by `D` ranks loads at any other
degree (each rank asks for the lanes it now owns).
"""

from __future__ import annotations

import functools
import json
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

    def __call__(self, batch: LocalBatch) -> dict[str, torch.Tensor | np.ndarray]:
        unknown = sorted(set(self.dtypes) - set(batch.data))
        if unknown:
            raise PlanError(f"dtypes names fields {unknown} that the batch lacks; its fields are "
                            f"{sorted(batch.data)}.")
        return {k: self._one(v, self.dtypes.get(k)) for k, v in batch.data.items()}

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
         device: str | torch.device | None = None) -> dict[str, torch.Tensor | np.ndarray]:
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


def to_dtensors(tensors: Mapping[str, Any], mesh: Any, mesh_dims: MeshDims = None) -> dict[str, Any]:
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
    return out


# --- state ------------------------------------------------------------------------------------
def _compact(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def encode_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Zephon's loader state in torch checkpoint form: plan and lane states as JSON strings.

    Strings make every lane one leaf for torch.distributed.checkpoint, whose loads fill a
    template's structure: a nested lane state whose keys changed since the template was made
    (an accumulator's carry) would otherwise be dropped silently.
    """
    out = dict(state)
    out["plan"] = _compact(state["plan"])
    out["lanes"] = {str(k): _compact(v) for k, v in state["lanes"].items()}
    return out


def decode_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `encode_state`; a plain Zephon state (`zephon.load_state`) passes unchanged."""
    if not isinstance(state, Mapping) or not isinstance(state.get("lanes", {}), Mapping):
        raise StateError("not a Zephon loader state: expected the dict that state_dict() returned "
                         f"(got {type(state).__name__}).")

    def value(v: Any, what: str) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return json.loads(v)
        except json.JSONDecodeError as e:
            raise StateError(f"the checkpoint's {what} is not valid JSON ({e}); the checkpoint is "
                             "damaged — restore an earlier one.") from e

    out = dict(state)
    out["plan"] = value(state.get("plan"), "plan")
    out["lanes"] = {k: value(v, f"lane {k}") for k, v in state.get("lanes", {}).items()}
    return out


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
        """State after the last batch this loader yielded (JSON-compatible, see module doc)."""
        return encode_state(self.loader.state())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues after the batches `state` had yielded (saved at any data-parallel degree)."""
        self.loader.restore(decode_state(state))

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> "TorchLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ZephonIterableDataset(IterableDataset):
    """Global batches as an `IterableDataset`, for `DataLoader(dataset, batch_size=None)`.

    Every `iter()` starts at the dataset's start state (`start_step`, or what `restore` set), so
    the dataset is re-iterable like any torch dataset; `ZephonDataLoader` moves that start as
    batches are consumed. Rank and world are fixed at construction, in the process that
    initialised `torch.distributed`, never in a worker.

    In a DataLoader worker `w` of `W` it yields steps `start+w, start+w+W, ...`; DataLoader's
    in-order round-robin fetching then returns exactly steps `start, start+1, ...`. That needs
    random access, so pipelines with a `Filter` (whose lanes advance sequentially) are refused
    with more than one worker. Keep `in_order=True` (the default) with workers. A `runner`
    runs inside whichever process iterates; other keyword arguments go to `zephon.Loader`.
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
        probe = self._loader(start_step)
        self.one_to_one = probe.one_to_one
        self._start: dict[str, Any] = probe.state()
        self._live: Loader | None = None  # the main-process loader of the newest iter()

    def _loader(self, start_step: int = 0, runner: Any = None) -> Loader:
        """A loader at `start_step`; only iterating ones get the runner (closing a loader closes it)."""
        return Loader(self.plan, self.sources, self.transforms, seed=self.seed, rank=self.rank,
                      world=self.world, runner=runner, start_step=start_step, **self.loader_options)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_live": None}  # a live loader holds generators; workers make their own

    @property
    def start_step(self) -> int:
        return int(self._start["step"])

    def restore(self, state: Mapping[str, Any]) -> None:
        """Future iterations start after the batches `state` (a `state_dict()`) had yielded."""
        loader = self._loader()
        loader.restore(decode_state(state))
        self._start = loader.state()

    def state_after(self, consumed: int) -> dict[str, Any]:
        """Zephon state after `consumed` batches of the newest iteration (torch checkpoint form)."""
        if consumed == 0:
            return encode_state(self._start)
        target = self.start_step + consumed
        if self.one_to_one:
            loader = self._loader(target)
            return encode_state(loader.state())
        live = self._live
        if live is None or live.step != target:
            raise StateError(f"the state after {consumed} batches of a pipeline with a Filter is "
                             "known only to the loader that produced them in this process; iterate "
                             "with num_workers=0 (ZephonDataLoader enforces this).")
        return encode_state(live.state())

    def __len__(self) -> int:
        """Batches left from the start state (only for finite plans without a Filter)."""
        n = self.plan.num_steps
        if n is None or not self.one_to_one:
            raise TypeError("this Zephon dataset has no length: its plan repeats forever or its "
                            "pipeline filters records.")
        return max(0, n - self.start_step)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        loader = self._loader(runner=self.runner)
        loader.restore(self._start)
        if info is None or info.num_workers == 1:
            if info is None:
                self._live = loader
            for batch in loader:
                yield self.emitter(batch)
            return
        if not self.one_to_one:
            raise PlanError(f"a pipeline with a Filter advances its lanes sequentially, so "
                            f"{info.num_workers} DataLoader workers cannot split it by step; use "
                            "num_workers=0 or 1.")
        for batch in loader.strided(loader.step + info.id, info.num_workers):
            yield self.emitter(batch)


class ZephonDataLoader(DataLoader):
    """A `DataLoader` over a `ZephonIterableDataset` with StatefulDataLoader-style state.

    `state_dict()` describes the batches handed to the training loop, not those workers have
    prefetched; `load_state_dict()` makes the next `iter()` continue from there. Iterating again
    continues where the last iteration stopped: a Zephon plan spans all epochs (use
    `.repeat(epochs)`; each epoch is reshuffled), so the loader is a cursor over global steps.

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
        if num_workers > 0 and not dataset.one_to_one:
            raise PlanError(f"num_workers={num_workers} with a Filter: such a pipeline advances its "
                            "lanes sequentially, so workers cannot split it by step, and its state "
                            "is known only in the process that iterates it. Use num_workers=0, or "
                            "TorchLoader.")
        super().__init__(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                         timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context,
                         prefetch_factor=prefetch_factor, persistent_workers=False, in_order=True)
        self._consumed = 0
        self._generation = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        ds: ZephonIterableDataset = self.dataset  # type: ignore[assignment]
        if self._consumed:
            ds.restore(self.state_dict())
            self._consumed = 0
        if ds.one_to_one and ds.plan.num_steps is not None and len(ds) == 0:
            log.warning("ZephonDataLoader is at the end of its plan (%d global batches): nothing "
                        "is left to yield. Build the plan with .repeat(epochs) to train longer, or "
                        "load_state_dict() an earlier state to replay.", ds.plan.num_steps)
        self._generation += 1
        return self._counted(super().__iter__(), self._generation)

    def _counted(self, batches: Iterator[dict[str, Any]], generation: int) -> Iterator[dict[str, Any]]:
        for batch in batches:
            if generation != self._generation:
                raise StateError("this ZephonDataLoader iterator was superseded by a newer iter() or "
                                 "load_state_dict(); state_dict() follows the newest one only, so "
                                 "consume one iterator at a time.")
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """State after the last batch handed out (JSON-compatible; see the module doc)."""
        return self.dataset.state_after(self._consumed)  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The next `iter()` continues after the batches `state` had handed out."""
        self.dataset.restore(state)  # type: ignore[attr-defined]
        self._consumed = 0
        self._generation += 1

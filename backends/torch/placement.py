"""Data-parallel placement: which row block of the global batch this process loads.

Which rows a process gets is decided by the plan's lanes, never by torch: the data-parallel rank
and degree come from `torch.distributed` (or a `DeviceMesh`), so every DDP rank holds exactly
global rows `[r*B/D, (r+1)*B/D)` and the concatenation over ranks is the numpy reference's global
batch for every degree `D` dividing the lane count. `to_dtensors` wraps a rank's rows as
`DTensor`s sharded on dim 0 over the mesh dims the batch is split over.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zephon.backends.torch.batch import TorchBatch
from zephon.errors import PlanError

MeshDims = str | int | Sequence[str | int] | None


def data_parallel(rank: int | None = None, world: int | None = None,
                  group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world) given, else from `torch.distributed` (in `group`), else (0, 1) — refused
    under torchrun's environment (`WORLD_SIZE` > 1) without `init_process_group`.

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
    env_world = os.environ.get("WORLD_SIZE", "1")
    if env_world.strip() not in ("", "1"):  # torchrun's environment: running as 0 of 1 is wrong
        raise PlanError(f"this process runs under torchrun (RANK={os.environ.get('RANK')!r}, "
                        f"WORLD_SIZE={env_world!r}) but torch.distributed is not initialised, so it "
                        "would load rank 0 of 1's rows — every rank the same data. Call "
                        "dist.init_process_group() before building the loader, or pass rank= and "
                        "world= explicitly.")
    return 0, 1


def all_gather_fn(group: dist.ProcessGroup | None = None) -> Any:
    """The all-gather ranks agree on a finite plan's end with (`zephon.exec.end`), through
    `torch.distributed` (in `group`); None when it is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _TorchGather(group)


class _TorchGather:
    """`[ints] -> every rank's [ints]` with `dist.all_gather_object` (two integers, once an epoch)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, values: list[int]) -> list[list[int]]:
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, list(values), group=self.group)
        return out


def _batch_dims(mesh: Any, batch_axes: MeshDims) -> list[int]:
    """Mesh dims the batch is split over, as indices in mesh order."""
    if batch_axes is None:
        return list(range(mesh.ndim))
    names = list(mesh.mesh_dim_names or ())
    out = []
    for d in ([batch_axes] if isinstance(batch_axes, (str, int)) else batch_axes):
        if isinstance(d, str):
            if d not in names:
                raise PlanError(f"mesh has no dim named {d!r}; its dims are {names}.")
            d = names.index(d)
        if not 0 <= int(d) < mesh.ndim:
            raise PlanError(f"mesh dim {d} is out of range for a {mesh.ndim}-d mesh.")
        out.append(int(d))
    if not out:
        raise PlanError("batch_axes is empty; name the mesh dims the batch is split over (or pass None: every dim).")
    return sorted(set(out))


def mesh_data_parallel(mesh: Any, batch_axes: MeshDims = None) -> tuple[int, int]:
    """(rank, world) of this process's row block when the batch is split over `batch_axes`.

    Rows are split over the dims in mesh order, as DTensor's `Shard(0)` placements split them,
    so rank = this process's coordinate on those dims, flattened row-major. Processes that differ
    only on other dims (replicas) share a rank and load the same rows.
    """
    dims = _batch_dims(mesh, batch_axes)
    coord = mesh.get_coordinate()
    if coord is None:
        raise PlanError("this process is not part of the device mesh; build the loader on the "
                        "mesh's ranks only.")
    sizes = [mesh.size(d) for d in dims]
    return int(np.ravel_multi_index([coord[d] for d in dims], sizes)), math.prod(sizes)


def to_dtensors(tensors: Mapping[str, Any], mesh: Any, batch_axes: MeshDims = None) -> TorchBatch:
    """Wraps local row blocks as `DTensor`s sharded on dim 0 over `batch_axes` (others replicate).

    Precondition (which `TorchLoader(mesh=...)` guarantees): the rows were loaded with the rank
    and world of `mesh_data_parallel(mesh, batch_axes)` from a plan with contiguous lane mapping,
    so every process holds one equal, contiguous block. No communication: shapes are known.
    Pass-through (non-tensor) fields stay local numpy arrays.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dims = _batch_dims(mesh, batch_axes)
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

"""Which rows this process loads: the data-parallel rank and degree, derived from the mesh.

`jax.make_array_from_process_local_data` places a process's rows on its addressable devices; for
that to be correct the process's rows must be exactly the contiguous block of the global batch
that its devices hold under the batch sharding. So the data-parallel rank and degree are
*derived from the mesh* (which rows each process's devices hold, `process_ranks`), never typed
in by the user: a mismatch there would silently train on the wrong rows. `plan_layout` checks
that a plan can feed a sharding, naming the mesh axes and sizes involved and what to change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zephon.errors import PlanError
from zephon.plan import Batching

BatchAxes = str | Sequence[str]
Shardings = NamedSharding | Mapping[str, NamedSharding]


@dataclass(frozen=True)
class DataParallel:
    """A process's place in the global batch: row block `rank` of `world` equal blocks.

    `world` counts the *distinct* row blocks across processes; processes whose devices hold the
    same rows (replicas over a non-batch mesh axis) share a rank and load the same rows.
    """

    rank: int
    world: int


def batch_sharding(mesh: Mesh, batch_axes: BatchAxes) -> NamedSharding:
    """`NamedSharding(mesh, PartitionSpec(batch_axes))`: the batch dim split over `batch_axes`."""
    axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    if not axes:
        raise PlanError("batch_axes is empty; name the mesh axes the batch dimension is split "
                        f"over, e.g. batch_axes={mesh.axis_names[0]!r}.")
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise PlanError(f"batch axes {unknown} are not axes of the mesh {dict(mesh.shape)}; "
                        f"choose batch_axes among {list(mesh.axis_names)}.")
    if len(set(axes)) != len(axes):
        raise PlanError(f"batch_axes {axes} names a mesh axis twice; name each axis once.")
    return NamedSharding(mesh, PartitionSpec(axes[0] if isinstance(batch_axes, str) else axes))


def _batch_axes(sharding: NamedSharding) -> tuple[str, ...]:
    """The mesh axes dim 0 is split over ((), if the batch dim is replicated)."""
    entry = sharding.spec[0] if len(sharding.spec) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def describe_batch_axes(sharding: NamedSharding) -> str:
    """"batch axes ('data'=2) of the mesh {...}": how error messages and logs name a sharding's
    batch split, so a user sees which mesh axes and sizes decide a process's rows."""
    sizes = ", ".join(f"{a!r}={sharding.mesh.shape[a]}" for a in _batch_axes(sharding))
    return f"batch axes ({sizes}) of the mesh {dict(sharding.mesh.shape)}"


def num_batch_shards(sharding: NamedSharding) -> int:
    """How many blocks the batch dim is cut into: the product of the batch axes' sizes."""
    return math.prod(sharding.mesh.shape[a] for a in _batch_axes(sharding))


def _process_index(device: jax.Device) -> int:
    return device.process_index


def process_ranks(sharding: NamedSharding,
                  process_of: Callable[[jax.Device], int] = _process_index) -> dict[int, DataParallel]:
    """{process: DataParallel} for every process with a device in the sharding's mesh.

    Works in units of batch shards (the answer does not depend on the batch size): each
    process's devices must hold one contiguous run of shards, and the distinct runs must tile
    the batch in equal blocks; block `r` is rank `r`. `process_of` maps a device to its process
    (tests pass a virtual assignment to play several hosts in one process).
    """
    shards = num_batch_shards(sharding)
    rows_only = NamedSharding(sharding.mesh, PartitionSpec(_batch_axes(sharding) or None))
    held: dict[int, set[int]] = {}
    for device, index in rows_only.devices_indices_map((shards,)).items():
        start, stop, _ = index[0].indices(shards)
        held.setdefault(process_of(device), set()).update(range(start, stop))
    spans: dict[int, tuple[int, int]] = {}
    for proc, rows in held.items():
        lo, hi = min(rows), max(rows) + 1
        if len(rows) != hi - lo:
            raise PlanError(
                f"process {proc} holds batch shards {sorted(rows)} of the {describe_batch_axes(sharding)}, "
                "which are not one contiguous block, so its rows cannot come from one data-parallel "
                "rank. Order the mesh devices by process (jax.make_mesh does), or put the "
                "per-process axis first among the batch axes.")
        spans[proc] = (lo, hi)
    blocks = sorted(set(spans.values()))
    size = blocks[0][1] - blocks[0][0]
    tiled = [(i * size, (i + 1) * size) for i in range(shards // size)] if shards % size == 0 else []
    if blocks != tiled:
        raise PlanError(
            f"the processes' batch shards {blocks} of the {describe_batch_axes(sharding)} do not split the "
            "batch into equal, disjoint blocks; give every process the same number of devices "
            "along the batch axes.")
    return {proc: DataParallel(blocks.index(span), len(blocks)) for proc, span in spans.items()}


def plan_layout(plan: Batching, sharding: NamedSharding, process: int | None = None,
                process_of: Callable[[jax.Device], int] = _process_index) -> DataParallel:
    """Checks that `plan` can feed `sharding` and returns process `process`'s rank and degree.

    Every error names the mesh axes and sizes involved and what to change.
    """
    shards = num_batch_shards(sharding)
    for step, size in plan.sizes.stretches():
        if size % shards:
            raise PlanError(
                f"batch size {size}{f' (from step {step})' if step else ''} is not divisible by the "
                f"{shards} batch shards of the {describe_batch_axes(sharding)}; use batch sizes that are "
                f"multiples of {shards}.")
    ranks = process_ranks(sharding, process_of)
    process = jax.process_index() if process is None else process
    if process not in ranks:
        raise PlanError(f"process {process} has no device in the mesh {dict(sharding.mesh.shape)}; "
                        "build the mesh over jax.devices(), which includes every process's devices.")
    dp = ranks[process]
    lanes = plan.lanes
    if lanes.count % dp.world:
        raise PlanError(
            f"lanes={lanes.count} cannot be split over the {dp.world} processes that load distinct "
            f"rows of the {describe_batch_axes(sharding)}; build the plan with a lane count divisible by "
            f"{dp.world} (e.g. lanes={math.lcm(lanes.count, dp.world)}).")
    if lanes.mapping != "contiguous" and dp.world > 1:
        raise PlanError(
            f"lanes mapping {lanes.mapping!r} gives each process rows scattered over the batch, but "
            f"a jax.Array sharded over the {describe_batch_axes(sharding)} needs each process's rows to be one "
            "contiguous block; build the plan with .lanes(L) (mapping='contiguous').")
    return dp


def check_shardings(sharding: Shardings) -> Shardings:
    """`Where(sharding=...)` checked: one `NamedSharding` or a non-empty mapping field ->
    `NamedSharding`, every one splitting the batch dim over the same mesh axes (a process's rows
    must be one block for every field); a mapping comes back as a plain dict."""
    items = [sharding] if isinstance(sharding, NamedSharding) else list(dict(sharding).values())
    if not items or not all(isinstance(s, NamedSharding) for s in items):
        raise PlanError("sharding must be a jax.sharding.NamedSharding or a non-empty mapping "
                        "field -> NamedSharding (the batch dim's mesh axes are read from its spec).")
    first = items[0]
    for s in items[1:]:
        if s.mesh != first.mesh or _batch_axes(s) != _batch_axes(first):
            raise PlanError(f"every field's sharding must split the batch dim the same way; got "
                            f"{describe_batch_axes(first)} and {describe_batch_axes(s)}.")
    return sharding if isinstance(sharding, NamedSharding) else dict(sharding)

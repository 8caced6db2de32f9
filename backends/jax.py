"""The JAX emitter: every field of a global batch becomes one global, sharded `jax.Array`.

A process materialises only the rows of the lanes it owns and hands them to
`jax.make_array_from_process_local_data`, which places them on its addressable devices. For that
to be correct the process's rows must be exactly the contiguous block of the global batch that
its devices hold under the batch sharding. So the data-parallel rank and degree are *derived from
the mesh* (which rows each process's devices hold), never typed in by the user: a mismatch there
would silently train on the wrong rows.

Because the loader's global batch is a function of the plan and the step only, the arrays are
identical for every mesh shape, number of processes and prefetch depth; only their placement
differs. A background thread builds the next batches on device while the train step runs, with a
bounded queue, and `state()` describes the batches the *caller* consumed, not the ones prefetched.

Batches are `JaxBatch`es — dicts of global arrays (a pytree like `dict`) with
`micro_batches(n)` for gradient accumulation: micro-batch `i` holds the `i`-th `1/n` of every
device's rows, sharded like the batch, so splitting costs no communication and
`join_micro_batches` (per device, the micro-batches' blocks concatenated) gives the batch back.
"""

from __future__ import annotations

import collections
import copy
import logging
import math
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zephon.errors import PlanError, WorkerError
from zephon.exec.loader import Loader, LocalBatch
from zephon.plan import Batch
from zephon.sources.base import RecordSource
from zephon.ops.base import Transform

log = logging.getLogger(__name__)

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


def _describe(sharding: NamedSharding) -> str:
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
                f"process {proc} holds batch shards {sorted(rows)} of the {_describe(sharding)}, "
                "which are not one contiguous block, so its rows cannot come from one data-parallel "
                "rank. Order the mesh devices by process (jax.make_mesh does), or put the "
                "per-process axis first among the batch axes.")
        spans[proc] = (lo, hi)
    blocks = sorted(set(spans.values()))
    size = blocks[0][1] - blocks[0][0]
    tiled = [(i * size, (i + 1) * size) for i in range(shards // size)] if shards % size == 0 else []
    if blocks != tiled:
        raise PlanError(
            f"the processes' batch shards {blocks} of the {_describe(sharding)} do not split the "
            "batch into equal, disjoint blocks; give every process the same number of devices "
            "along the batch axes.")
    return {proc: DataParallel(blocks.index(span), len(blocks)) for proc, span in spans.items()}


def plan_layout(plan: Batch, sharding: NamedSharding, process: int | None = None,
                process_of: Callable[[jax.Device], int] = _process_index) -> DataParallel:
    """Checks that `plan` can feed `sharding` and returns process `process`'s rank and degree.

    Every error names the mesh axes and sizes involved and what to change.
    """
    shards = num_batch_shards(sharding)
    if plan.size % shards:
        raise PlanError(
            f"batch size {plan.size} is not divisible by the {shards} batch shards of the "
            f"{_describe(sharding)}; use a batch size that is a multiple of {shards}.")
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
            f"rows of the {_describe(sharding)}; build the plan with a lane count divisible by "
            f"{dp.world} (e.g. lanes={math.lcm(lanes.count, dp.world)}).")
    if lanes.mapping != "contiguous" and dp.world > 1:
        raise PlanError(
            f"lanes mapping {lanes.mapping!r} gives each process rows scattered over the batch, but "
            f"a jax.Array sharded over the {_describe(sharding)} needs each process's rows to be one "
            "contiguous block; build the plan with .lanes(L) (mapping='contiguous').")
    return dp


def _jax_dtype(dtype: np.dtype) -> bool:
    """Whether JAX holds `dtype` (bfloat16 and the float8 types are numpy 'V' kinds)."""
    try:
        jax.dtypes.canonicalize_dtype(dtype)
        return dtype.names is None and dtype.itemsize <= 8
    except TypeError:
        return False


def device_dtype_array(name: str, arr: np.ndarray) -> np.ndarray:
    """`arr` in the dtype JAX will hold it in, refusing what JAX cannot hold or would corrupt.

    Without `jax_enable_x64`, JAX narrows 64-bit values silently; integers that do not fit would
    wrap, so they are an error here rather than wrong data on device.
    """
    if arr.dtype.kind in "OUS" or (arr.dtype.kind == "V" and not _jax_dtype(arr.dtype)):
        raise PlanError(
            f"field {name!r} has dtype {arr.dtype} (bytes, strings or ragged values), which cannot "
            "become a jax.Array; map it to fixed-size numeric arrays with a transform (tokenize and "
            f"pack or pad), or leave it out with exclude=({name!r},).")
    target = jax.dtypes.canonicalize_dtype(arr.dtype)
    if target == arr.dtype:
        return arr
    if arr.dtype.kind in "iu" and arr.size:
        info = np.iinfo(target)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise PlanError(
                f"field {name!r} holds {arr.dtype} values in [{lo}, {hi}] that do not fit {target}, "
                "the dtype JAX uses while jax_enable_x64 is off; enable it "
                "(jax.config.update('jax_enable_x64', True)) or map the field to a narrower dtype.")
    return arr.astype(target)


@dataclass(frozen=True)
class Emitter:
    """Turns this process's rows of a global batch into global arrays, one per field."""

    shardings: Shardings
    exclude: frozenset[str] = frozenset()

    def sharding(self, name: str) -> NamedSharding:
        """The sharding field `name` is emitted with."""
        if isinstance(self.shardings, NamedSharding):
            return self.shardings
        if name not in self.shardings:
            raise PlanError(f"field {name!r} has no entry in the sharding mapping (fields with one: "
                            f"{sorted(self.shardings)}); add one or pass exclude=({name!r},).")
        return self.shardings[name]

    def host(self, batch: LocalBatch) -> HostBatch:
        """The host-side half: fields checked and converted to device dtypes, with global shapes."""
        return {name: (device_dtype_array(name, arr), batch.global_shape(name))
                for name, arr in batch.data.items() if name not in self.exclude}

    def device(self, host: HostBatch) -> JaxBatch:
        """The device half: global arrays, transfers dispatched asynchronously."""
        return JaxBatch({name: jax.make_array_from_process_local_data(self.sharding(name), arr, shape)
                         for name, (arr, shape) in host.items()})

    def __call__(self, batch: LocalBatch) -> JaxBatch:
        """Global arrays of `batch`, transferred to the devices before returning."""
        return jax.block_until_ready(self.device(self.host(batch)))


HostBatch = dict[str, tuple[np.ndarray, tuple[int, ...]]]


class JaxBatch(dict):
    """`{field: jax.Array}` of a global batch, with `micro_batches(n)`; a pytree like `dict`
    (flattened in sorted key order), so it goes straight into `jax.jit` functions."""

    def micro_batches(self, n: int) -> list["JaxBatch"]:
        """`n` micro-batches, each sharded like the batch (see `micro_batches`)."""
        return micro_batches(self, n)


def _flatten_with_keys(b: JaxBatch) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
    keys = tuple(sorted(b))
    return [(jax.tree_util.DictKey(k), b[k]) for k in keys], keys


jax.tree_util.register_pytree_with_keys(
    JaxBatch, _flatten_with_keys, lambda keys, values: JaxBatch(zip(keys, values)),
    lambda b: ([b[k] for k in sorted(b)], tuple(sorted(b))))


def _device_blocks(name: str, arr: jax.Array) -> list[Any]:
    shards = arr.addressable_shards
    if not shards:
        raise PlanError(f"field {name!r} has no shard on this process's devices")
    return shards


def micro_batches(batch: Mapping[str, jax.Array], n: int) -> list[JaxBatch]:
    """`n` micro-batches of a batch of global arrays, for gradient accumulation.

    Every device's block of rows is cut into `n` equal consecutive pieces; micro-batch `i` is the
    global array of the `i`-th pieces, with the batch's sharding and `1/n` of its rows. No data
    moves between devices or processes. Per device, the micro-batches' blocks concatenate to the
    batch's block (`join_micro_batches` gives the batch back), so the rows a step trains on —
    and the sum of gradients over its micro-batches — do not depend on `n`. `n` must divide the
    rows each device holds.
    """
    from zephon.backends.numpy import check_micro_count

    out: list[dict[str, jax.Array]] = []
    for name, arr in batch.items():
        shards = _device_blocks(name, arr)
        rows = shards[0].data.shape[0]
        n = check_micro_count(n, rows, f"the block of field {name!r} on each device ({rows} "
                                       f"of {arr.shape[0]} global rows)")
        out = out or [{} for _ in range(n)]
        m = rows // n
        shape = (arr.shape[0] // n,) + tuple(arr.shape[1:])
        for i in range(n):
            out[i][name] = jax.make_array_from_single_device_arrays(
                shape, arr.sharding, [s.data[i * m:(i + 1) * m] for s in shards])
    return [JaxBatch(o) for o in out]


def join_micro_batches(micro: Sequence[Mapping[str, jax.Array]]) -> JaxBatch:
    """The batch `micro_batches` cut: per device, its micro-batch blocks concatenated in order."""
    import jax.numpy as jnp

    if not micro:
        raise PlanError("join_micro_batches needs at least one micro-batch")
    out: dict[str, jax.Array] = {}
    for name, first in micro[0].items():
        per_device: dict[Any, list[Any]] = {}
        for mb in micro:
            for s in _device_blocks(name, mb[name]):
                per_device.setdefault(s.device, []).append(s.data)
        shape = (first.shape[0] * len(micro),) + tuple(first.shape[1:])
        out[name] = jax.make_array_from_single_device_arrays(
            shape, first.sharding, [jnp.concatenate(blocks) if len(blocks) > 1 else blocks[0]
                                    for blocks in per_device.values()])
    return JaxBatch(out)


class _End:
    """Queue marker: the loader is exhausted."""


@dataclass(frozen=True)
class _Failure:
    """Queue marker: the producer raised; the consumer re-raises it."""

    error: BaseException


Item = tuple[HostBatch, dict[str, Any]] | _End | _Failure


class _Prefetcher:
    """A thread that runs the loader and the host-side conversion ahead of the caller.

    Device transfers are dispatched from the caller's thread (see `JaxLoader.__next__`): on the
    CPU backend a transfer issued from a second thread while a jitted step runs collectives
    across the fake devices can starve the step's rendezvous (XLA aborts after 40 s).

    The queue holds at most `depth` batches and the thread one more in progress. The thread
    references neither the prefetcher nor the JaxLoader, so an abandoned JaxLoader is collected
    and its finalizer stops the thread.
    """

    def __init__(self, loader: Loader, emit: Emitter, depth: int) -> None:
        self._queue: queue.Queue[Item] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(loader, emit, self._queue, self._stop),
                                        name="zephon-jax-prefetch", daemon=True)
        self._thread.start()

    def take(self) -> Item:
        """The next item; a thread that is gone without a word becomes an error, never a hang."""
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return _Failure(WorkerError("the prefetch thread stopped (the JaxLoader was "
                                                "closed meanwhile); restore a state or create a "
                                                "new JaxLoader."))

    def stop(self) -> None:
        """Ends the thread and drops the batches it built ahead.

        Draining wakes a producer blocked on the full queue, so it sees the stop at once instead
        of after building another batch.
        """
        self._stop.set()
        self._drain()
        self._thread.join()
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


def _produce(loader: Loader, emit: Emitter, out: queue.Queue[Item], stop: threading.Event) -> None:
    def put(item: Item) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    try:
        while not stop.is_set():
            try:
                batch = next(loader)
            except StopIteration:
                put(_End())
                return
            put((emit.host(batch), loader.position()))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the consumer
        put(_Failure(e))


class JaxLoader:
    """Global batches as dicts of sharded `jax.Array`s, prefetched to device.

    Args:
      plan, sources, transforms: as for `zephon.Loader`.
      mesh, batch_axes: the batch dim is split over `batch_axes` (a mesh axis name or a tuple of
        names); every field gets `NamedSharding(mesh, PartitionSpec(batch_axes))`.
      sharding: instead of mesh/batch_axes, a `NamedSharding` for every field, or a mapping
        field -> `NamedSharding` (e.g. tokens also split over a sequence axis). The batch dim's
        partitioning must be the same for every field.
      prefetch: batches kept in flight to the devices ahead of the caller; a background thread
        loads and converts them on the host, and their transfers are dispatched (asynchronously)
        from the caller's thread (0: build each batch when asked, in the caller's thread). Memory
        holds at most 2 * prefetch + 1 batches beyond the one the caller has.
      exclude: fields not to emit (e.g. raw bytes kept for debugging in the numpy backend).
      seed, runner, start_step: passed to `zephon.Loader`.

    The process's data-parallel rank and degree come from the mesh and `jax.process_index()`.
    Use it as a context manager or call `close()` to stop the prefetch thread promptly.
    """

    def __init__(self, plan: Batch, sources: RecordSource | Sequence[RecordSource] | Mapping[int, RecordSource],
                 transforms: Sequence[Transform] = (), *, mesh: Mesh | None = None,
                 batch_axes: BatchAxes = "data", sharding: Shardings | None = None, prefetch: int = 2,
                 exclude: Sequence[str] = (), seed: int = 0, runner: Any = None, start_step: int = 0,
                 **loader_options: Any) -> None:
        if not isinstance(plan, Batch):
            raise PlanError("JaxLoader needs a complete plan: stream.lanes(L).batch(B)")
        if (mesh is None) == (sharding is None):
            raise PlanError("pass either mesh= (with batch_axes=) or sharding=, not both or neither.")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise PlanError(f"prefetch must be a non-negative integer (batches ahead), got {prefetch!r}")
        shardings = batch_sharding(mesh, batch_axes) if sharding is None else _check_shardings(sharding)
        self.emit = Emitter(shardings, frozenset(exclude))
        first = shardings if isinstance(shardings, NamedSharding) else next(iter(shardings.values()))
        self.layout = plan_layout(plan, first)
        log.info("process %d loads row block %d of %d of every global batch (%s)", jax.process_index(),
                 self.layout.rank, self.layout.world, _describe(first))
        self.prefetch = prefetch
        self._loader = Loader(plan, sources, transforms, seed=seed, rank=self.layout.rank,
                              world=self.layout.world, runner=runner, start_step=start_step,
                              **loader_options)
        self._state = self._loader.position()
        self._prefetcher: _Prefetcher | None = None
        self._finalizer: weakref.finalize | None = None
        self._ended: _End | _Failure | None = None
        self._ahead: collections.deque[tuple[dict[str, jax.Array], dict[str, Any]]] = collections.deque()
        self._last: _End | _Failure | None = None  # what the producer ended with, after _ahead

    @property
    def step(self) -> int:
        """The next global batch the caller will receive."""
        return int(self._state["step"])

    def __iter__(self) -> "JaxLoader":
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if isinstance(self._ended, _Failure):
            raise self._ended.error
        if self._ended is not None:
            raise StopIteration
        if self.prefetch == 0:
            try:
                arrays = self.emit(next(self._loader))
            except StopIteration:
                self._ended = _End()
                raise
            self._state = self._loader.position()
            return arrays
        if self._prefetcher is None:
            self._prefetcher = _Prefetcher(self._loader, self.emit, self.prefetch)
            self._finalizer = weakref.finalize(self, self._prefetcher.stop)
        # Keep `prefetch` batches' transfers in flight: dispatched now, awaited by the step.
        while self._last is None and len(self._ahead) < self.prefetch:
            item = self._prefetcher.take()
            if isinstance(item, (_End, _Failure)):
                self._last = item
            else:
                self._ahead.append((self.emit.device(item[0]), item[1]))
        if not self._ahead:
            self._ended = self._last
            return self.__next__()
        arrays, self._state = self._ahead.popleft()
        return arrays

    def _halt(self) -> None:
        """Stops the prefetch thread; what it built ahead is dropped (the state is the consumed one)."""
        if self._finalizer is not None:
            self._finalizer()
        self._prefetcher = self._finalizer = None
        self._ahead.clear()
        self._last = None

    # --- state -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON state after the last batch the caller received (prefetched batches excluded).

        In a multi-process run each process's state holds its own lanes; for pipelines with a
        filter, `zephon.merge_states` them before resuming at another data-parallel degree.
        """
        return self._loader.state_from(copy.deepcopy(self._state))

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues from `state` (from any mesh or data-parallel degree of the same plan)."""
        self._halt()
        self._loader.restore(state)
        self._state = self._loader.position()
        self._ended = None

    get_state = state
    set_state = restore

    def close(self) -> None:
        """Stops the prefetch thread and releases the loader; safe to call twice."""
        self._halt()
        self._loader.close()
        self._ended = _End()

    def __enter__(self) -> "JaxLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_shardings(sharding: Shardings) -> Shardings:
    items = [sharding] if isinstance(sharding, NamedSharding) else list(dict(sharding).values())
    if not items or not all(isinstance(s, NamedSharding) for s in items):
        raise PlanError("sharding must be a jax.sharding.NamedSharding or a non-empty mapping "
                        "field -> NamedSharding (the batch dim's mesh axes are read from its spec).")
    first = items[0]
    for s in items[1:]:
        if s.mesh != first.mesh or _batch_axes(s) != _batch_axes(first):
            raise PlanError(f"every field's sharding must split the batch dim the same way; got "
                            f"{_describe(first)} and {_describe(s)}.")
    return sharding if isinstance(sharding, NamedSharding) else dict(sharding)


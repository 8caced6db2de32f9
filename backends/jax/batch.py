"""Jax batches: this process's rows as global, sharded `jax.Array`s, and their micro-batches.

`Emitter` converts a process's rows to the dtypes JAX holds (refusing what it cannot hold or
would corrupt) and makes one global array per field with its sharding. Batches are `JaxBatch`es
— dicts of global arrays (a pytree like `dict`) with `micro_batches(n)` for gradient
accumulation: micro-batch `i` holds the `i`-th `1/n` of every device's rows, sharded like the
batch, so splitting costs no communication and `join_micro_batches` (per device, the
micro-batches' blocks concatenated) gives the batch back.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from zephon.backends.jax.placement import Shardings
from zephon.errors import PlanError
from zephon.exec.batch import check_micro_count
from zephon.exec.loader import LocalBatch
from zephon.telemetry import Telemetry

HostBatch = dict[str, tuple[np.ndarray, tuple[int, ...]]]


def jax_holds_dtype(dtype: np.dtype) -> bool:
    """Whether JAX holds `dtype` (bfloat16 and the float8 types are numpy 'V' kinds): what
    `device_dtype_array` refuses otherwise, and what checks of a pipeline's fields ask."""
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
    if arr.dtype.kind in "OUS" or (arr.dtype.kind == "V" and not jax_holds_dtype(arr.dtype)):
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
    #: when set, the seconds of host conversion and transfer dispatch go to its 'emit' stage
    telemetry: Telemetry | None = field(default=None, compare=False, repr=False)

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
        t0 = time.perf_counter()
        out = {name: (device_dtype_array(name, arr), batch.global_shape(name))
               for name, arr in batch.data.items() if name not in self.exclude}
        if self.telemetry is not None:
            self.telemetry.add("emit", time.perf_counter() - t0)
        return out

    def device(self, host: HostBatch) -> JaxBatch:
        """The device half: global arrays, transfers dispatched asynchronously."""
        t0 = time.perf_counter()
        out = JaxBatch({name: jax.make_array_from_process_local_data(self.sharding(name), arr, shape)
                        for name, (arr, shape) in host.items()})
        if self.telemetry is not None:
            self.telemetry.add("emit", time.perf_counter() - t0)
        return out

    def __call__(self, batch: LocalBatch) -> JaxBatch:
        """Global arrays of `batch`, transferred to the devices before returning."""
        return jax.block_until_ready(self.device(self.host(batch)))



class JaxBatch(dict):
    """`{field: jax.Array}` of a global batch, with `micro_batches(n)`; a pytree like `dict`
    (flattened in sorted key order), so it goes straight into `jax.jit` functions."""

    def micro_batches(self, n: int) -> list[JaxBatch]:
        """`n` micro-batches, each sharded like the batch (see `micro_batches`)."""
        return micro_batches(self, n)


def _flatten_with_keys(b: JaxBatch) -> tuple[list[tuple[Any, Any]], tuple[str, ...]]:
    keys = tuple(sorted(b))
    return [(jax.tree_util.DictKey(k), b[k]) for k in keys], keys


jax.tree_util.register_pytree_with_keys(
    JaxBatch, _flatten_with_keys, lambda keys, values: JaxBatch(zip(keys, values)),
    lambda b: ([b[k] for k in sorted(b)], tuple(sorted(b))))


def _device_blocks(name: str, arr: jax.Array) -> Sequence[Any]:
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

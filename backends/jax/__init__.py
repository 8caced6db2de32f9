"""The JAX emitter: every field of a global batch becomes one global, sharded `jax.Array`.

A process materialises only the rows of the lanes it owns and hands them to
`jax.make_array_from_process_local_data`, which places them on its addressable devices. Which
rows those are is *derived from the mesh* (`placement`), never typed in by the user. Because the
loader's global batch is a function of the plan and the step only, the arrays are identical for
every mesh shape, number of processes and prefetch depth; only their placement differs.

One concept a module: `placement` (rank and degree from the mesh, sharding checks), `batch`
(dtype conversion, global arrays, `JaxBatch`, micro-batches), `prefetch` (the background thread
and its queue), `loader` (`JaxLoader`). Import from here.
"""

from zephon.backends.jax.batch import (
    Emitter,
    HostBatch,
    JaxBatch,
    device_dtype_array,
    jax_holds_dtype,
    join_micro_batches,
    micro_batches,
)
from zephon.backends.jax.loader import JaxLoader
from zephon.backends.jax.placement import (
    BatchAxes,
    DataParallel,
    Shardings,
    batch_sharding,
    check_shardings,
    describe_batch_axes,
    num_batch_shards,
    plan_layout,
    process_ranks,
)
from zephon.backends.jax.prefetch import Item

__all__ = [
    "BatchAxes", "DataParallel", "Emitter", "HostBatch", "Item", "JaxBatch", "JaxLoader", "Shardings",
    "batch_sharding", "check_shardings", "describe_batch_axes", "device_dtype_array", "jax_holds_dtype",
    "join_micro_batches", "micro_batches", "num_batch_shards",
    "plan_layout", "process_ranks",
]

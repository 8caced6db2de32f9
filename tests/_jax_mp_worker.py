"""One process of a 2-process jax.distributed run (4 fake CPU devices each, 8 global).

It builds global arrays with `JaxLoader` over a mesh of all 8 devices, then digests, per lane,
the rows that actually landed on its addressable devices and writes them as JSON. The test merges
both processes' digests into step fingerprints and compares them with a single-process run. No
cross-process computation is needed, so no CPU collectives are configured.

`pipeline()` imports numpy and zephon core only, so the test can import it without jax.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from zephon import Filter, RandomMap, Source
from zephon.sources.memory import ArraySource

RECORDS = 997
LANES = 8
BATCH = 32


def _jitter(record: dict, rng: np.random.Generator) -> dict:
    return {**record, "x": record["x"] + rng.standard_normal(record["x"].shape).astype(np.float32)}


def pipeline():
    """(plan, source, transforms): shuffle + repeat, a filter (per-lane cursors) and a random map."""
    x = np.arange(RECORDS * 6, dtype=np.float32).reshape(RECORDS, 3, 2)
    source = ArraySource({"x": x, "label": np.arange(RECORDS, dtype=np.int32) % 10})
    plan = Source(RECORDS).shuffle(11).repeat().lanes(LANES).batch(BATCH)
    transforms = (Filter(lambda c: c["label"] != 3, batched=True, name="not_label_3"), RandomMap(_jitter))
    return plan, source, transforms


def local_rows(array) -> tuple[int, np.ndarray]:
    """(first global row, rows) of the contiguous block this process's devices hold."""
    blocks: dict[int, np.ndarray] = {}
    for shard in array.addressable_shards:
        start, _, _ = shard.index[0].indices(array.shape[0])
        blocks.setdefault(start, np.asarray(shard.data))
    starts = sorted(blocks)
    return starts[0], np.concatenate([blocks[s] for s in starts])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--mesh", default="2,4", help="mesh shape over the 8 global devices")
    ap.add_argument("--batch-axes", default="data,fsdp")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.sharding import Mesh

    from zephon.backends.jax import JaxLoader
    from zephon.exec.loader import LocalBatch
    from zephon.fingerprints import lane_digests

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
                               process_id=args.process_id)
    try:
        shape = tuple(int(s) for s in args.mesh.split(","))
        names = ("data", "fsdp")[: len(shape)]
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        plan, source, transforms = pipeline()
        axes = tuple(args.batch_axes.split(","))
        loader = JaxLoader(plan, source, transforms, mesh=mesh, batch_axes=axes if len(axes) > 1 else axes[0])
        rank, world = loader.layout.rank, loader.layout.world
        owned = plan.lanes.owned(rank, world)
        digests: dict[int, dict[int, str]] = {}
        with loader:
            for step in range(args.steps):
                arrays = next(loader)
                data, firsts = {}, set()
                for name, arr in arrays.items():
                    first, data[name] = local_rows(arr)
                    firsts.add(first)
                if firsts != {rank * plan.size // world}:
                    raise AssertionError(f"process rows start at {firsts}, expected block {rank} of {world}")
                digests[step] = lane_digests(LocalBatch(step, data, owned, plan.per_lane, plan.size))
            state = loader.state()
        with open(args.out, "w") as f:
            json.dump({"process": jax.process_index(), "rank": rank, "world": world,
                       "local_devices": len(jax.local_devices()), "global_devices": jax.device_count(),
                       "digests": digests, "state": state}, f)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()

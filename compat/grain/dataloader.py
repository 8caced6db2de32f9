"""`grain.DataLoader` with an `IndexSampler`, on Zephon, with Grain's batches.

The sampler's order is the plan (`order.GrainSampler`, laid out batch-major over shards and
workers by `order.GrainLoaderOrder`); Grain's operations become the transforms of `transforms`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain

from zephon.errors import PlanError
from zephon.exec.loader import Loader
from zephon.fingerprints import run_fingerprints
from zephon.ops.base import Transform
from zephon.plan import Node
from zephon.runners.base import Runner

from .compile import READ_AHEAD
from .iterator import CollatingLoader, Iterator
from .order import ContiguousBatches, GrainIndex, GrainLoaderOrder, GrainSampler
from .sources import GrainSource
from .streams import BatchStep
from .transforms import GrainFilter, GrainMap, GrainRandomMap, with_collate


def _shard_tuple(opts: Any) -> tuple[int, int, bool]:
    return int(opts.shard_index), int(opts.shard_count), bool(opts.drop_remainder)


class DataLoader:
    """`grain.DataLoader` with an `IndexSampler`, on Zephon, with Grain's batches.

    Takes Grain's arguments. Zephon's global batch is the concatenation over Grain shards of
    each shard's batch, so this loader (rank = `shard_options.shard_index`) yields exactly the
    batches `grain.DataLoader` yields on that shard — including the different order Grain
    produces with `worker_count` > 0, where each worker batches its own slice. Zephon's own
    parallelism is the `runner`; `worker_count` only selects which Grain order to reproduce.
    `RandomMap` gets Grain's per-record generator `Philox(key=sampler_seed + index)`.
    """

    def __init__(self, *, data_source: Any, sampler: Any, operations: Sequence[Any] = (),
                 worker_count: int | None = 0, worker_buffer_size: int = 1,
                 shard_options: Any = None, read_options: Any = None, enable_profiling: bool = False,
                 lanes: int | None = None, rank: int | None = None, world: int | None = None,
                 runner: Runner | None = None, read_ahead: int = READ_AHEAD) -> None:
        del worker_buffer_size, read_options, enable_profiling  # Grain tuning knobs; no effect on data
        if not isinstance(sampler, grain.samplers.IndexSampler):
            raise PlanError(f"{type(sampler).__name__} is not supported; Grain order is reproduced "
                            "for grain.samplers.IndexSampler.")
        opts = shard_options if shard_options is not None else sampler._shard_options
        index, count, _ = _shard_tuple(opts)
        s_index, s_count, s_drop = _shard_tuple(sampler._shard_options)
        if s_count != 1 and (s_count, s_index) != (count, index):
            raise PlanError(f"the sampler is sharded {s_index}/{s_count} but the loader {index}/"
                            f"{count}; give both the same shard options (or NoSharding() to the sampler).")
        self.workers = max(int(worker_count or 0), 1)
        self.grain_args = {"data_source": data_source, "sampler": sampler, "operations": list(operations),
                           "worker_count": worker_count, "shard_options": opts}
        batch: Any = None  # the final grain.transforms.Batch
        transforms: list[Transform] = []
        filtered, tag = False, None
        for i, t in enumerate(operations):
            if isinstance(t, grain.transforms.Batch):
                if i != len(operations) - 1:
                    raise PlanError("Batch must be the last operation: Zephon's plan ends in the "
                                    "global batch.")
                batch = t
            elif isinstance(t, grain.transforms.Map):
                transforms.append(GrainMap(t))
            elif isinstance(t, grain.transforms.Filter):
                transforms.append(GrainFilter(t))
                filtered = True
            elif isinstance(t, grain.transforms.RandomMap):
                tag = 0
                transforms.append(GrainRandomMap(t, sampler._seed, "sampler", tag))
            else:
                raise PlanError(f"{type(t).__name__} is not supported by grain.DataLoader's Zephon "
                                "twin; use Map, RandomMap, Filter and a final Batch.")
        self._tail_batch = batch if batch is not None and (batch.batch_fn is not None or (
            not batch.drop_remainder and count == 1 and sampler._num_epochs is not None and (
                filtered or sampler._num_records * sampler._num_epochs % batch.batch_size))) else None
        if self._tail_batch is not None and (count != 1 or self.workers != 1):
            raise PlanError("Batch(batch_fn=...) needs worker_count=0 and no sharding here: Zephon "
                            "calls it on whole batches of one stream; pad/pack with a Map instead.")
        per_shard = batch.batch_size if batch is not None else 1
        self.batched = batch is not None
        stream: Node = GrainSampler(sampler._num_records, s_count, s_drop, sampler._shuffle,
                                    sampler._seed, sampler._num_epochs)
        if tag is not None:
            stream = GrainIndex(stream, tag)
        lanes = count if lanes is None else int(lanes)
        if lanes % count:
            raise PlanError(f"lanes={lanes} must be a multiple of the shard count {count} so that "
                            "each Grain shard's batch is whole lanes.")
        rows = count * per_shard
        identity = lanes == count and self.workers == 1
        if filtered and not identity:
            raise PlanError("with a Filter, Grain fills each shard's (each worker's) batch from its "
                            f"own stream; reproduce it with lanes={count} and worker_count=0.")
        if not identity:
            stream = GrainLoaderOrder(stream, count, per_shard, self.workers)
            stream = ContiguousBatches(stream, lanes, rows // lanes)
        self.plan = stream.lanes(lanes).batch(rows, remainder="drop")  # Grain's end: its own
        self.transforms = with_collate(tuple(transforms)) if self.batched else tuple(transforms)
        self.sources = {0: GrainSource(data_source)}
        self.rank = index if rank is None else rank
        self.world = count if world is None else world
        self.runner = runner
        self.read_ahead = read_ahead

    def loader(self, *, rank: int | None = None, world: int | None = None) -> Loader:
        cls = CollatingLoader if self.batched else Loader
        return cls(self.plan, self.sources, self.transforms, rank=self.rank if rank is None else rank,
                   world=self.world if world is None else world, runner=self.runner,
                   read_ahead=self.read_ahead)

    def __iter__(self) -> Any:
        b = self._tail_batch
        if b is not None:  # Grain's smaller last batch / batch_fn: batch the element stream
            ops = self.grain_args["operations"][:-1]
            twin = DataLoader(**{**self.grain_args, "operations": ops}, runner=self.runner,
                              read_ahead=self.read_ahead)
            return BatchStep(Iterator(twin.loader(), batched=False), b.batch_size, b.drop_remainder,
                             b.batch_fn)
        return Iterator(self.loader(), batched=self.batched)

    def fingerprints(self, steps: int, *, world: int | None = None) -> list[str]:
        world = self.world if world is None else world
        return run_fingerprints([self.loader(rank=r, world=world) for r in range(world)], steps)

    def to_grain(self, shard_index: int | None = None) -> Any:
        """The real `grain.DataLoader` with the same arguments (optionally for another shard)."""
        args = dict(self.grain_args)
        if shard_index is not None:
            _, count, drop = _shard_tuple(args["shard_options"])
            opts = grain.sharding.ShardOptions(shard_index, count, drop)
            s = args["sampler"]
            sampler_opts = opts if s._shard_options.shard_count != 1 else s._shard_options
            args["sampler"] = grain.samplers.IndexSampler(
                s._num_records, shard_options=sampler_opts, shuffle=s._shuffle,
                num_epochs=s._num_epochs, seed=s._seed)
            args["shard_options"] = opts
        return grain.DataLoader(**args)

"""`Dataset`: a Grain-shaped pipeline (`grain.MapDataset` spellings) that runs on Zephon.

Each method records one step, as Grain would create one node (the graph of `compile._Op`);
`compile.compile_pipeline` turns the graph into a Zephon plan and transforms when the pipeline
is first iterated, and the emitters (`loader`, `to_jax`, `to_torch`, `to_torch_dataset`) run it.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import grain
import numpy as np

from zephon.errors import PlanError
from zephon.exec.loader import Loader
from zephon.exec.steps import read_refs
from zephon.fingerprints import run_fingerprints
from zephon.ops.base import Accumulator, Operator, Transform, run_transforms
from zephon.ops.pack import Pack
from zephon.plan import Batching
from zephon.plan import Mapping as LaneMapping
from zephon.runners.base import Runner

from .compile import GRAIN_INFINITE, Order, _Compiled, _Config, _Op, compile_pipeline, row_ops, to_grain
from .iterator import CollatingLoader, Iterator
from .packing import pack_step
from .pipeline import TailMixin
from .records import elements
from .tail import TAIL_ITER, TAIL_ONLY

_ITER_OPS = ("map", "filter", "random_map", "map_with_index", "to_iter_dataset", "batch", "seed",
             "pack", *TAIL_ONLY)

_DEFAULT_CONFIG = _Config()  # frozen, so one shared default is safe


class Dataset(TailMixin):
    """A Grain-shaped pipeline (`MapDataset` spellings) that runs on Zephon.

    Build it exactly like a `grain.MapDataset`; `order="grain"` (default) reproduces Grain's
    records and batches, `order="zephon"` uses Zephon's own shuffle/mix (a Feistel permutation
    and a periodic interleave; faster to resolve, different order). Zephon's own knobs:
    `lanes(L)` (canonical lanes, the unit of state and ownership), `shard(rank, world)`
    (data-parallel rank; rows of the global batch, not a slice of the data) and `runner(r)`.
    """

    def __init__(self, op: _Op, config: _Config = _DEFAULT_CONFIG) -> None:
        self._op = op
        self._config = config

    # --- Grain constructors -------------------------------------------------------------------
    @classmethod
    def source(cls, source: Any, *, order: Order = "grain", name: str = "") -> Dataset:
        """Wraps a Grain data source, a sequence, or a Zephon `RecordSource`."""
        if order not in ("grain", "zephon"):
            raise PlanError(f"order must be 'grain' or 'zephon', got {order!r}")
        return cls(_Op("source", (), {"source": source, "name": name}), _Config(order=order))

    @classmethod
    def range(cls, start: int, stop: int | None = None, step: int = 1, *,
              order: Order = "grain") -> Dataset:
        """`MapDataset.range`: the integers of Python's `range(start, stop, step)`."""
        r = range(start) if stop is None else range(start, stop, step)
        return cls.source(r, order=order, name=f"range({r.start}, {r.stop}, {r.step})")

    @classmethod
    def mix(cls, datasets: Sequence[Dataset], weights: Sequence[float] | None = None, *,
            by: str = "samples", count_field: str | None = None,
            schedule: Sequence[tuple[int, Sequence[float]]] = ()) -> Dataset:
        """`MapDataset.mix`: Grain's deterministic proportional interleave of `datasets`.

        `by="tokens"` (Zephon): the weights apply to realised tokens, inside every lane — each
        lane takes its next document from the dataset furthest below its share of the tokens
        so far (`zephon.Mix(..., by="tokens")`); `by="trained_tokens"` counts only the tokens
        whose `loss_mask` is non-zero (`zephon.ops.chat.Chat` writes it). Each dataset tokenizes before the mix (e.g.
        `.map(Tokenize(...))`); what is counted is the length of column `count_field` (default:
        the feature a later packing step packs, else `tokens`). Such a mix is the last ordering
        step (shuffle/repeat each dataset before it) and has no random access. `schedule`
        (by tokens only): `((step, weights), ...)`, a curriculum (`zephon.Mix(schedule=...)`).
        """
        if by not in ("samples", "tokens", "trained_tokens"):
            raise PlanError(f"mix(by=...) must be 'samples', 'tokens' or 'trained_tokens', got {by!r}")
        if schedule and by == "samples":
            raise PlanError("mix(schedule=...) needs by='tokens': a mix by samples has one set of "
                            "weights (Grain's proportional interleave).")
        if isinstance(datasets, Mapping) or (by == "samples" and not schedule and any(
                isinstance(d, Dataset) and d._in_iter() for d in datasets)):
            from .iterdata import iter_mix
            return iter_mix(datasets, weights)  # Grain's IterDataset.mix
        datasets = list(datasets)
        if not datasets:
            raise PlanError("mix needs at least one dataset")
        if len({d._config.order for d in datasets}) > 1:
            raise PlanError("mixed datasets were built with different orders; build them all with "
                            "the same order= ('grain' or 'zephon').")
        for d in datasets:
            d._check_open("mix")
        return cls(_Op("mix", tuple(d._op for d in datasets),
                       {"weights": None if weights is None else tuple(weights), "by": by,
                        "count_field": count_field, "schedule": tuple(schedule)}), datasets[0]._config)

    # --- Grain transformations ------------------------------------------------------------------
    def _then(self, kind: str, **args: Any) -> Dataset:
        self._check_open(kind)
        return Dataset(_Op(kind, (self._op,), args), self._config)

    def _check_open(self, kind: str) -> None:
        if self._in_iter() and kind not in _ITER_OPS:
            raise PlanError(f"{kind} is a MapDataset step and cannot follow to_iter_dataset() or a "
                            "packing step; move it before them (as in Grain).")

    def _in_iter(self) -> bool:
        return any(o.kind in ("to_iter_dataset", "pack", *TAIL_ITER) for o in self._op.upstream())

    @property
    def packed(self) -> bool:
        """Whether the pipeline packs (its rows are packed sequences, counted by tokens)."""
        return any(o.kind == "pack" for o in self._op.upstream())

    @property
    def _token_mixed(self) -> bool:
        return any(o.kind == "mix" and o.args.get("by") in ("tokens", "trained_tokens")
                   for o in self._op.upstream())

    def _seed_for(self, kind: str, seed: int | None) -> int | None:
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 32:
                raise PlanError(f"{kind} seeds are integers in [0, 2**32), got {seed!r}")
            return int(seed)
        return _Op(kind, (self._op,)).default_seed()

    def seed(self, seed: int) -> Dataset:
        """`ds.seed(s)`: downstream shuffles/random maps derive their seeds as Grain does."""
        return self._then("seed", seed=int(seed))

    def shuffle(self, seed: int | None = None) -> Dataset:
        s = self._seed_for("shuffle", seed)
        if s is None:
            raise PlanError("`shuffle` requires a seed. Please provide it with `ds.seed(seed)` or "
                            "shuffle(seed=...).")
        return self._then("shuffle", seed=s)

    def repeat(self, num_epochs: int | None = None, *, reseed_each_epoch: bool = True) -> Dataset:
        if not reseed_each_epoch:  # Grain's: every epoch reads epoch 0's elements (`tail`)
            return self._then("repeat_same", num_epochs=num_epochs)
        return self._then("repeat", num_epochs=num_epochs)

    def slice(self, sl: slice) -> Dataset:
        return self._then("slice", slice=sl)

    def map(self, transform: Any) -> Dataset:
        """Grain's `map` (a `grain.transforms.Map` or callable on records), or a Zephon lane
        operator: a row operator (`Tokenize`, `zephon.Map`/`FlatMap`/`Filter`/`RandomMap`, any
        `Transform`; records are stacked into columns for it) or a `zephon.ops.pack.Pack`
        (packing, as `pack()` does; its fields keep the names it was built with)."""
        if isinstance(transform, Accumulator):
            if not isinstance(transform, Pack):
                raise PlanError(f"{type(transform).__name__} is an accumulator; the Grain-shaped "
                                "API runs zephon.ops.pack.Pack. Use zephon.Loader for others.")
            return self._then("pack", pack=transform, fields=(transform.field,), names=None, grain=None)
        return self._then("map", transform=transform, iter=self._in_iter())

    def filter(self, transform: Any) -> Dataset:
        return self._then("filter", transform=transform, iter=self._in_iter())

    def pack(self, length_struct: Any, mode: str = "concat", *, num_packing_bins: int = 8,
             padding_struct: Any = None, max_sequences_per_bin: int | None = None,
             names: str = "maxtext", _grain: Any = None) -> Dataset:
        """Packs token sequences into rows (Zephon's `Pack` on every lane; see `zephon.compat.grain`).

        length_struct: `{feature: seq_len}` as in Grain's packers (several features must be
          copies of one sequence, e.g. MaxText's `inputs`/`targets`), or an int for records
          that are bare token arrays.
        mode: 'concat' (concat-then-split: nothing lost, no padding), 'first_fit' or 'best_fit'
          (at most `num_packing_bins` rows open; longer documents are split, never dropped).
        names: 'maxtext' (`inputs`, `targets` = next tokens, `inputs_segmentation`,
          `targets_segmentation`, `inputs_position`, `targets_position`), 'grain' (Grain's
          packer layout: per feature `k`, `k`, `k_segment_ids`, `k_positions`, unshifted) or
          'zephon' (`tokens`, `targets`, `segment_ids`, `positions`, `loss_mask`, `cu_seqlens`).
        """
        pack, fields = pack_step(length_struct, mode, num_packing_bins=num_packing_bins,
                                 padding_struct=padding_struct,
                                 max_sequences_per_bin=max_sequences_per_bin, names=names)
        return self._then("pack", pack=pack, fields=fields, names=names, grain=_grain)

    def random_map(self, transform: Any, *, seed: int | None = None) -> Dataset:
        s = self._seed_for("random_map", seed)
        if s is None:
            raise PlanError("`random_map` requires a seed. Please either provide it with "
                            "`ds.seed(seed)` before any random transformations or pass it directly "
                            "with `ds.random_map(transform, seed=seed)`.")
        return self._then("random_map", transform=transform, seed=s, iter=self._in_iter())

    def map_with_index(self, transform: Any) -> Dataset:
        return self._then("map_with_index", transform=transform, iter=self._in_iter())

    def batch(self, batch_size: int | None = None, *, drop_remainder: bool = False,
              batch_fn: Callable[[Sequence[Any]], Any] | None = None,
              schedule: Sequence[tuple[int, int]] | None = None) -> Dataset:
        """Grain's batch. The plan's global batch where it gives Grain's batches; a smaller last
        batch (drop_remainder=False) or a `batch_fn` is assembled after the plan (`tail`).

        `schedule` (Zephon's, not Grain's) is a batch-size ramp `((0, B0), (step1, B1), ...)`
        that is part of the plan (see `zephon.plan.batchsizes`); `batch_size` may then be omitted.
        """
        if schedule is not None:
            from zephon.plan.batchsizes import parse_schedule

            entries = parse_schedule(schedule)
            if not entries or entries[0][0] != 0 or (batch_size is not None and batch_size != entries[0][1]):
                raise PlanError(f"schedule={list(schedule)!r} must start at step 0 with the batch "
                                "size (omit batch_size, or give the schedule's first size).")
            batch_size = entries[0][1]
            schedule = tuple(entries[1:])
        if batch_fn is not None and schedule:
            raise PlanError("batch(schedule=...) with batch_fn is not supported: a schedule is part "
                            "of the plan; pad with map() before batch() instead.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise PlanError(f"batch_size must be a positive integer, got {batch_size!r}")
        return self._then("batch", batch_size=int(batch_size), drop_remainder=bool(drop_remainder),
                          batch_fn=batch_fn, **({"schedule": schedule} if schedule else {}))

    def to_iter_dataset(self, read_options: Any = None, *, allow_nones: bool = False) -> Dataset:
        """Grain's switch to `IterDataset`; kept so pipelines read the same (Zephon needs no
        read threads here: runners parallelise whole steps)."""
        if allow_nones:  # Grain's: the MapDataset's Nones are kept (read by index, `tail`)
            return self._then("iter_nones")
        return self._then("to_iter_dataset")._read_options(read_options)

    def apply(self, transformations: Any) -> Dataset:
        """Grain's `apply`: dispatches Map/RandomMap/Filter/MapWithIndex/Batch by type."""
        ts = transformations if isinstance(transformations, (list, tuple)) else [transformations]
        ds = self
        for t in ts:
            if isinstance(t, grain.transforms.Batch):
                ds = ds.batch(t.batch_size, drop_remainder=t.drop_remainder, batch_fn=t.batch_fn)
            elif isinstance(t, grain.transforms.Map):
                ds = ds.map(t)
            elif isinstance(t, grain.transforms.RandomMap):
                ds = ds.random_map(t)
            elif isinstance(t, grain.transforms.Filter):
                ds = ds.filter(t)
            elif isinstance(t, grain.transforms.MapWithIndex):
                ds = ds.map_with_index(t)
            elif isinstance(t, (Transform, Accumulator)):
                ds = ds.map(t)
            else:
                raise PlanError(f"unsupported transformation {type(t).__name__}; use Map, RandomMap, "
                                "Filter, MapWithIndex or Batch.")
        return ds

    def __getitem__(self, index: int | builtins.slice) -> Any:  # builtins: `slice` is a method here
        """A slice gives a sliced dataset; an int the element (or batch) there, as in Grain."""
        if isinstance(index, slice):
            return self.slice(index)
        return self._item(int(index))

    # --- Zephon knobs ---------------------------------------------------------------------------
    def lanes(self, count: int, mapping: LaneMapping = "contiguous") -> Dataset:
        """Canonical lanes: fix this for runs that restore at another data-parallel degree."""
        return Dataset(self._op, replace(self._config, lanes=int(count), mapping=mapping))

    def shard(self, rank: int, world: int) -> Dataset:
        """Data-parallel rank `rank` of `world`: iterates its rows of every global batch."""
        return Dataset(self._op, replace(self._config, rank=int(rank), world=int(world)))

    def runner(self, runner: Runner | None) -> Dataset:
        """Executes steps with a Zephon runner (threads/processes); changes speed, never data."""
        return Dataset(self._op, replace(self._config, runner=runner))

    def read_ahead(self, rows: int) -> Dataset:
        """Rows read and transformed ahead in one group (default `READ_AHEAD`); speed only."""
        return Dataset(self._op, replace(self._config, read_ahead=int(rows)))

    # --- the plan -------------------------------------------------------------------------------
    @property
    def batched(self) -> bool:
        """Whether the plan ends in a global batch (the steps the plan runs include a batch)."""
        head = self._op if self._remainder_only else self._split.head
        return head is not None and any(o.kind == "batch" for o in head.upstream())

    @functools.cached_property
    def _compiled(self) -> _Compiled:
        if self._split.head is None:
            raise PlanError("this pipeline starts with a Grain iterator dataset (a mix of "
                            "IterDatasets, interleave or a file iterator); it has no Zephon plan.")
        return compile_pipeline(self._op if self._remainder_only else self._split.head, self._config)

    @property
    def plan(self) -> Batching:
        """The Zephon plan (JSON-serialisable; see `plan.explain(step)`)."""
        return self._compiled.plan

    @property
    def transforms(self) -> tuple[Operator, ...]:
        return self._compiled.transforms

    @property
    def record_sources(self) -> dict[int, Any]:
        return self._compiled.sources

    def loader(self, *, rank: int | None = None, world: int | None = None, start_step: int = 0) -> Loader:
        """The Zephon `Loader` of rank `rank` (default: the dataset's `shard`)."""
        self._no_tail("loader()")
        c = self._compiled
        cls = CollatingLoader if self.batched else Loader
        return cls(c.plan, c.sources, c.transforms, rank=rank if rank is not None else self._config.rank or 0,
                   world=world if world is not None else self._config.world or 1,
                   runner=self._config.runner, start_step=start_step, read_ahead=self._config.read_ahead)

    def to_jax(self, mesh: Any = None, batch_axes: Any = "data", **kwargs: Any) -> Any:
        """A `zephon.backends.jax.JaxLoader` over this pipeline: sharded global `jax.Array`s.

        The process's rows come from the mesh, not from `shard()`. Bytes/str fields are object
        arrays; drop them with `exclude=[...]` or decode them in a map.
        """
        from zephon.backends.jax import JaxLoader
        c = self._check_backend("to_jax")
        return JaxLoader(c.plan, c.sources, c.transforms, mesh=mesh,
                         batch_axes=batch_axes, runner=self._config.runner, **kwargs)

    def to_torch(self, **kwargs: Any) -> Any:
        """A `zephon.backends.torch.TorchLoader` over this pipeline (`shard()` gives rank/world;
        otherwise torch.distributed's)."""
        from zephon.backends.torch import TorchLoader
        c = self._check_backend("to_torch")
        return TorchLoader(c.plan, c.sources, c.transforms, runner=self._config.runner,
                           **self._shard_kwargs(kwargs))

    def to_torch_dataset(self, **kwargs: Any) -> Any:
        """A `zephon.backends.torch.ZephonIterableDataset` over this pipeline, for
        `ZephonDataLoader(dataset, num_workers=...)` (`shard()` gives rank/world; otherwise
        torch.distributed's)."""
        from zephon.backends.torch import ZephonIterableDataset
        c = self._check_backend("to_torch_dataset")
        return ZephonIterableDataset(c.plan, c.sources, c.transforms, runner=self._config.runner,
                                     **self._shard_kwargs(kwargs))

    def __iter__(self) -> Any:
        if self._tail is not None:
            if self._config.world is None:
                return self._tail.iterator()
            self._no_tail("shard()")  # a rank iterates its rows of the plan's full global batches
        return Iterator(self.loader(), batched=self.batched)

    def __len__(self) -> int:
        if self._tail is not None:
            return self._tail.length()
        if self.packed or self._token_mixed:
            raise TypeError("a packed or token-mixed pipeline has no length: how many rows it makes "
                            "depends on the documents' token counts (like Grain's IterDataset).")
        n = self._compiled.stream.length
        n = GRAIN_INFINITE if n is None else int(n)
        if not self.batched:
            return n
        if self._compiled.plan.num_steps is not None and any(
                o.kind == "filter" for o in self._op.upstream()):
            return int(self._compiled.plan.num_steps)
        batch = next(o for o in self._op.upstream() if o.kind == "batch")
        bs = batch.args["batch_size"]
        return n // bs if batch.args["drop_remainder"] else -(-n // bs)  # Grain's len

    def _item(self, index: int) -> Any:
        if self._tail is not None:
            return self._tail.item(index + len(self) if index < 0 else index)
        if self.packed or self._token_mixed:
            raise PlanError(f"ds[{index}]: a packed or token-mixed pipeline has no random access "
                            "(where a row starts depends on every document before it); iterate it.")
        if index < 0:
            index += len(self)
        if index >= len(self):
            return self._past_the_end(index)
        if self.batched:
            return Iterator.emit(self.loader().batch(index), batched=True)
        c = self._compiled
        refs = c.stream.resolve([index])
        cols, kept = run_transforms(row_ops(c.transforms), read_refs(c.sources, refs), refs, 0)
        return elements(cols)[0] if len(kept) else None

    def __repr__(self) -> str:
        return f"zephon.compat.grain.Dataset({' -> '.join(o.kind for o in list(self._op.upstream())[::-1])})"

    def fingerprints(self, steps: int, *, world: int | None = None) -> list[str]:
        """Step fingerprints of the first `steps` global batches, computed by `world` ranks."""
        world = world or self._config.world or 1
        return run_fingerprints([self.loader(rank=r, world=world) for r in range(world)], steps)

    # --- the same pipeline on real Grain -------------------------------------------------------
    def to_grain(self) -> Any:
        """The equivalent real `grain.MapDataset`/`IterDataset` (same ops, seeds and sources)."""
        return to_grain(self._op, {})


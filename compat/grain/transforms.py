"""Grain's transforms as Zephon row operators, and Zephon's operators in a Grain pipeline.

`GrainMap`, `GrainMapWithIndex`, `GrainRandomMap` and `GrainFilter` run a Grain transform (or a
plain callable) on the records of the `RECORD` column, record by record, exactly as Grain hands
them over; an error names the record and source. `MapWithIndex` and Grain-exact `RandomMap`
read each row's Grain index from the references (`order.GrainIndex`). `Branches` runs each
mixed dataset's own chain on its rows, `Collate` stacks records into columns at the end, and
`LaneOp` wraps a Zephon row operator (`Tokenize`, `zephon.Map`, ...) so it sees columns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from zephon.errors import PlanError
from zephon.ops.base import (
    Accumulator,
    Transform,
    call_on_record,
    record_rng,
    record_seeds,
    run_transforms,
    stable_name,
)
from zephon.plan import Refs
from zephon.sources.base import Columns
from zephon.sources.columns import objects

from .order import grain_index_column
from .records import RECORD, RNG, collate, records_of, records_to_columns
from .warn import warn_once


class GrainTransform(Transform):
    """A transform of this package: it passes through a Grain-shaped pipeline as-is, where any
    other Zephon `Transform` is wrapped in `LaneOp` (records stacked into columns for it)."""

    def checked_identity(self) -> dict[str, Any]:
        """Grain checkpoints pipelines of lambdas; so does this, saying once what is off."""
        ident = self.identity()
        if not stable_name(ident["name"]):
            warn_once(f"identity:{ident['name']}",
                      f"{ident['name']} is a lambda or a nested function: checkpoints record it "
                      "by name only, so restoring into a pipeline whose function changed is not "
                      "detected (Zephon's pipeline-identity check is off for it; Grain has none). "
                      "Define it at module level to keep the check.")
            return ident
        return super().checked_identity()


def _callable_name(t: Any) -> str:
    """Stable name of a function (its qualname) or transform object (its class): part of the
    loader state's identity, so it must not contain addresses."""
    return getattr(t, "__qualname__", None) or type(t).__qualname__


def _with_records(cols: Columns, records: Sequence[Any]) -> Columns:
    out = {RECORD: objects(records)}
    if RNG in cols:
        out[RNG] = cols[RNG]
    return out


def _tag_values(refs: Refs, tag: int, what: str) -> np.ndarray:
    values = refs.extra.get(grain_index_column(tag))
    if values is None:
        raise PlanError(f"{what} needs each element's Grain index, which only plans built by "
                        "zephon.compat.grain carry (a GrainIndex node); build the pipeline with "
                        "Dataset/DataLoader from zephon.compat.grain.")
    return values


@dataclass(frozen=True)
class GrainMap(GrainTransform):
    """`grain.transforms.Map` (or a callable) applied to each record."""

    transform: Any

    @property
    def fn(self) -> Callable[[Any], Any]:
        return self.transform.map if isinstance(self.transform, grain.transforms.Map) else self.transform

    @property
    def name(self) -> str:
        return f"grain.Map({_callable_name(self.transform)})"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        fn, what = self.fn, self.name
        return _with_records(cols, [call_on_record(fn, what, refs, i, r) for i, r in enumerate(records_of(cols))]), None


@dataclass(frozen=True)
class GrainMapWithIndex(GrainTransform):
    """`grain.transforms.MapWithIndex`: fn(index, record) with Grain's index at this depth.

    The index is the element's position in the dataset at the point of the pipeline where the
    op was applied (epochs counted on: epoch * len + position), exactly as Grain's
    `map_with_index` numbers it. It is a function of the plan position alone, so it is the same
    whatever the lane count, data-parallel degree or runner.
    """

    transform: Any
    tag: int

    @property
    def name(self) -> str:
        return f"grain.MapWithIndex({_callable_name(self.transform)})"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        fn = (self.transform.map_with_index if isinstance(self.transform, grain.transforms.MapWithIndex)
              else self.transform)
        index = _tag_values(refs, self.tag, self.name)
        return _with_records(cols, [call_on_record(fn, self.name, refs, i, int(index[i]), r)
                                    for i, r in enumerate(records_of(cols))]), None


@functools.lru_cache(maxsize=64)
def _philox_key(seed: int) -> np.ndarray:
    """The Philox key Grain's `np.random.Philox(seed)` derives (through SeedSequence)."""
    return np.random.Philox(seed).state["state"]["key"]


def grain_map_rng(seed: int, index: int) -> np.random.Generator:
    """The generator Grain's `MapDataset.random_map(seed=seed)` hands element `index`.

    Grain resets a `Philox(seed)` to counter [0, 0, 0, index] with an empty buffer; a fresh
    Philox with that key and counter is the same state.
    """
    counter = np.array([0, 0, 0, index], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(counter=counter, key=_philox_key(seed)))


@dataclass(frozen=True)
class GrainRandomMap(GrainTransform):
    """`grain.transforms.RandomMap`: fn(record, rng).

    `rng` modes:
      "dataset": Grain's `MapDataset.random_map` generator for the element's Grain index
                 (Philox(seed) at counter [0,0,0,index]) — equal to Grain's draws.
      "sampler": `grain.DataLoader`'s per-record generator, Philox(key=seed + sampler index),
                 or None when the sampler has no seed — equal to Grain's draws. As in Grain, one
                 generator per record is shared by all RandomMaps of the loader (`RNG` column).
      "record":  Zephon's data-derived generator from (seed, source, record, epoch): a record
                 draws the same values wherever it appears, equal to Grain only in distribution.
    """

    transform: Any
    seed: int | None
    rng: str = "dataset"
    tag: int = -1

    def __post_init__(self) -> None:
        if self.rng not in ("dataset", "sampler", "record"):
            raise PlanError(f"GrainRandomMap rng must be 'dataset', 'sampler' or 'record', got {self.rng!r}")
        if self.rng != "sampler" and self.seed is None:
            raise PlanError("`random_map` requires a seed. Please either provide it with "
                            "`ds.seed(seed)` before any random transformations or pass it directly "
                            "with `ds.random_map(transform, seed=seed)` (Grain's rule).")

    @property
    def name(self) -> str:
        return f"grain.RandomMap[{self.rng}]({_callable_name(self.transform)})"

    def _rngs(self, cols: Columns, refs: Refs) -> Sequence[np.random.Generator | None]:
        if RNG in cols:
            return list(cols[RNG])
        if self.rng == "record":
            return [record_rng(int(s)) for s in record_seeds(int(self.seed), refs)]  # type: ignore[arg-type]
        index = _tag_values(refs, self.tag, self.name)
        if self.rng == "sampler":
            if self.seed is None:
                return [None] * len(index)
            return [np.random.Generator(np.random.Philox(key=int(self.seed) + int(g))) for g in index]
        return [grain_map_rng(int(self.seed), int(i)) for i in index]  # type: ignore[arg-type]

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        fn = (self.transform.random_map if isinstance(self.transform, grain.transforms.RandomMap)
              else self.transform)
        rngs = self._rngs(cols, refs)
        out = _with_records(cols, [call_on_record(fn, self.name, refs, i, r, g)
                                   for i, (r, g) in enumerate(zip(records_of(cols), rngs))])
        if self.rng == "sampler":
            out[RNG] = objects(rngs)
        return out, None


@dataclass(frozen=True)
class GrainFilter(GrainTransform):
    """`grain.transforms.Filter` (or a predicate): keeps records where it returns True."""

    transform: Any
    one_to_one = False

    @property
    def name(self) -> str:
        return f"grain.Filter({_callable_name(self.transform)})"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray]:
        fn = self.transform.filter if isinstance(self.transform, grain.transforms.Filter) else self.transform
        recs = records_of(cols)
        keep = np.fromiter((bool(call_on_record(fn, self.name, refs, i, r)) for i, r in enumerate(recs)),
                           dtype=bool, count=len(recs))
        return cols, keep


@dataclass(frozen=True)
class Branches(GrainTransform):
    """Per-dataset transforms of a mix: rows of each child's sources go through its own chain.

    Grain applies `mix([a.map(f), b.map(g)])`'s maps before mixing; here every row carries its
    source id, so each child's chain runs on that child's rows and the results are merged back
    in row order. Children may read different schemas as long as their chains end in one.
    """

    branches: tuple[tuple[tuple[int, ...], tuple[Transform, ...]], ...]

    @property
    def one_to_one(self) -> bool:  # type: ignore[override]
        return all(t.one_to_one for _, chain in self.branches for t in chain)

    @property
    def name(self) -> str:
        return "Branches[" + "; ".join(f"{list(ids)}: " + ",".join(t.op_name for t in chain)
                                       for ids, chain in self.branches) + "]"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray]:
        n = len(refs)
        keep = np.zeros(n, dtype=bool)
        out: Columns = {}
        for ids, chain in self.branches:
            rows = np.flatnonzero(np.isin(refs.source, ids))
            if not rows.size:
                continue
            sub, kept = run_transforms(chain, {k: v[rows] for k, v in cols.items()}, refs.take(rows), seed)
            dest = rows[kept]
            keep[dest] = True
            for k, v in sub.items():
                if k not in out:
                    out[k] = np.zeros((n,) + v.shape[1:], dtype=v.dtype) if v.dtype != object else (
                        np.empty(n, dtype=object))
                elif out[k].shape[1:] != v.shape[1:] or out[k].dtype != v.dtype:
                    raise PlanError(f"mixed datasets give field {k!r} as {out[k].dtype}"
                                    f"{out[k].shape[1:]} and {v.dtype}{v.shape[1:]}; map every "
                                    "dataset to one schema before mix.")
                out[k][dest] = v
            if out.keys() != sub.keys():
                raise PlanError(f"mixed datasets give different fields ({sorted(out)} vs "
                                f"{sorted(sub)}); map every dataset to one schema before mix.")
        return out, keep


@dataclass(frozen=True)
class Collate(GrainTransform):
    """Stacks the Grain records of a batch into columns (the last transform of a pipeline)."""

    @property
    def name(self) -> str:
        return "grain.Collate"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        if RECORD not in cols:
            return cols, None
        return records_to_columns(list(cols[RECORD])), None


def with_collate(chain: tuple[Any, ...]) -> tuple[Any, ...]:
    """Appends `Collate` to a one-to-one chain, where it runs inside the runner's workers.

    A chain with a filter is collated by `CollatingLoader` once the step's rows are assembled
    instead: the loader evaluates such chains in several passes, and a pass whose rows are all
    filtered out has no records to learn the column names from. A chain with a packing step
    (an accumulator) gets `Collate` after it, where it only acts if Grain maps follow the pack.
    """
    if has_accumulator(chain) or all(t.one_to_one for t in chain):
        return chain + (Collate(),)
    return chain


def has_accumulator(chain: Sequence[Any]) -> bool:
    return any(isinstance(t, Accumulator) for t in chain)


@dataclass(frozen=True, eq=False)
class LaneOp(GrainTransform):
    """A Zephon row operator inside a Grain-shaped pipeline (`ds.map(Tokenize(...))`).

    Zephon operators work on columns: Grain records arriving in the `RECORD` column are stacked
    into columns first (dict keys become field names, as in `records_to_columns`). The operator
    keeps its own identity (name, version, config) and seed, so a checkpoint names it, and a
    pipeline of Zephon operators computes what `zephon.Loader` computes with them.
    """

    op: Transform

    def __repr__(self) -> str:
        return f"LaneOp({self.op.op_name})"

    @property
    def one_to_one(self) -> bool:  # type: ignore[override]
        return bool(self.op.one_to_one)

    @property
    def expands(self) -> bool:  # type: ignore[override]
        return bool(self.op.expands)

    @property
    def op_name(self) -> str:
        return self.op.op_name

    @property
    def version(self) -> int:  # type: ignore[override]
        return int(self.op.version)

    def config(self) -> dict[str, Any]:
        return self.op.config()

    def identity(self) -> dict[str, Any]:
        return self.op.identity()

    def checked_identity(self) -> dict[str, Any]:
        return self.op.checked_identity()

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, Any]:
        if not len(refs) and (not cols or RECORD in cols):
            # no record to learn the column names from (a window past the end of a finite
            # stream, or all filtered out): nothing to do
            return {}, None
        if RECORD in cols or RNG in cols:
            cols = collate(cols)
        return self.op.apply(cols, refs, seed)

"""Grain compatibility: Grain's sources, transforms, API shape, record order and checkpoints.

A Grain user switches by changing the import and keeps the pipeline:

    ds = grain.MapDataset.source(src).shuffle(seed=7).repeat().map(f).batch(32)        # Grain
    ds = zephon.compat.grain.Dataset.source(src).shuffle(seed=7).repeat().map(f).batch(32)

`iter(ds)` yields numpy batches with Grain's structure, and in the default `order="grain"`
they are Grain's batches bit for bit: the plan computes Grain's own shuffle, mix and sampler
order (`zephon.compat.grain_order`), `MapWithIndex` sees Grain's index and `RandomMap` draws
from Grain's own per-index generator. Zephon's lanes, data-parallel ranks, runners and
checkpoints come on top, and none of them changes the batches. `Dataset.to_grain()` builds the
equivalent real Grain pipeline and `grain_fingerprints` digests its batches exactly like
`zephon.verify` digests Zephon's, so Grain is one more column of the verify matrix.

Records. A Grain source returns Python objects; they travel as one object column (`RECORD`)
through the Grain transforms, which therefore see exactly what Grain would hand them, and are
stacked into columns once at the end: dict keys (nested with "/") or tuple positions become
field names, a bare value becomes `VALUE`; numbers and arrays stack as Grain's `np.stack` does,
while bytes and str stay object arrays — exact, and the same whatever the data-parallel degree
(Grain's fixed-width S/U arrays would depend on which rows are stacked together).

LM pipelines. `map()` also takes Zephon lane operators — `Tokenize`, `zephon.Map`/`Filter`/
`FlatMap`, a `zephon.ops.pack.Pack` — and Grain's packing datasets keep their names and
arguments under `experimental` (`zg.experimental.ConcatThenSplitIterDataset(ds, length_struct=
{"tokens": 2048})`, `FirstFitPackIterDataset`, `BestFitPackIterDataset(..., num_packing_bins=8)`):
they compile to `Pack(seq_len, mode)` running in every lane of Zephon's lane engine, with
MaxText's field names by default (`names="grain"`: Grain's packer layout). `Dataset.mix(...,
by="tokens")` balances realised tokens inside every lane. Such pipelines batch, shard, resume
from the one Zephon JSON state (at another data-parallel degree after `merge_states`) and feed
`to_jax`/`to_torch`/`to_torch_dataset` like any other. Packing is Zephon's: it loses no token
(documents longer than seq_len are split, never dropped), so rows equal Grain's only for
concat-then-split at `lanes(1)`. A finite stream (no `repeat()`) ends at its last full global
batch: the partly filled rows still open then are not emitted (Grain pads and emits them).

Plans holding Grain nodes load with `Node.from_json` only after `import zephon.compat.grain`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator as TypingIterator, Mapping, Sequence

import grain
import numpy as np

from zephon.errors import DecodeError, PlanError, StateError
from zephon.exec.loader import Loader, LocalBatch
from zephon.exec.steps import read_refs
from zephon.plan import Batch, Mix, Node, Refs, Repeat, Shuffle, Slice, Source
from zephon.sources.base import Columns, RecordSource, as_indices
from zephon.ops.base import Accumulator, Transform, record_rng, record_seeds, run_transforms
from zephon.ops.pack import Pack
from zephon.verify import global_fingerprint, run_fingerprints

from zephon.compat.grain_order import (  # noqa: F401 - re-exported; importing registers nodes
    GRAIN_INFINITE, ContiguousBatches, GrainIndex, GrainLoaderOrder, GrainMix, GrainSampler,
    GrainShuffle, IndexedRefs, even_split, grain_proportions, index_shuffle, mix_selection)

log = logging.getLogger(__name__)

RECORD = "__record__"
"""Column holding whole Grain records (Python objects) between source and final stacking."""
VALUE = "__value__"
"""Field name of a record that is a bare value rather than a dict or tuple."""
RNG = "__rng__"
"""Column of per-record generators that `grain.DataLoader` shares between its RandomMaps."""

Order = str  # "grain" | "zephon"

READ_AHEAD = 2048
"""Rows a compat loader reads (and transforms) ahead in one group. Grain records pass through
Python transforms record by record, so large group reads buy little and cost latency: the first
batch, and every restore, waits for the whole group."""


# --- records <-> columns -------------------------------------------------------------------------

def _flatten(x: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(x, Mapping):
        if not x:
            raise DecodeError(f"record field {path or '<root>'!r} is an empty dict; Zephon stacks "
                              "records into columns and needs at least one leaf per dict.")
        for k, v in x.items():
            if not isinstance(k, str) or "/" in k or not k:
                raise DecodeError(f"record key {k!r} under {path or '<root>'!r} must be a non-empty "
                                  "str without '/' (Zephon joins nested keys with '/').")
            _flatten(v, f"{path}/{k}" if path else k, out)
    elif isinstance(x, (tuple, list)):
        if not x:
            raise DecodeError(f"record field {path or '<root>'!r} is an empty sequence; return at "
                              "least one value or drop the field.")
        for i, v in enumerate(x):
            _flatten(v, f"{path}/{i}" if path else str(i), out)
    else:
        out[path or VALUE] = x


def flatten_record(record: Any) -> dict[str, Any]:
    """{field name: leaf} of one Grain record (dicts nest with '/', tuples by position)."""
    out: dict[str, Any] = {}
    _flatten(record, "", out)
    return out


def _is_text(v: Any) -> bool:
    return isinstance(v, (bytes, str)) or (isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "SU")


def _plain_text(v: Any) -> Any:
    """np.str_/np.bytes_/0-d S|U arrays -> str/bytes, so digests do not see numpy's repr."""
    if isinstance(v, np.ndarray):
        v = v.item()
    return str(v) if isinstance(v, str) else bytes(v)


def stack_leaves(leaves: Sequence[Any]) -> np.ndarray:
    """One column from one leaf per record, as Grain's `np.stack` batches it.

    Numbers and equal-shape arrays stack (Python ints -> int64 as in Grain); bytes/str become an
    object array of exact values; ragged or mixed leaves an object array of the leaves.
    """
    if all(_is_text(v) for v in leaves):
        col = np.empty(len(leaves), dtype=object)
        for i, v in enumerate(leaves):
            col[i] = _plain_text(v)
        return col
    arrs = [np.asarray(v) for v in leaves]
    first = arrs[0]
    if first.dtype.kind not in "OSUV" and all(a.shape == first.shape and a.dtype.kind not in "OSUV"
                                             for a in arrs):
        return np.stack(arrs)
    col = np.empty(len(leaves), dtype=object)
    for i, v in enumerate(leaves):
        col[i] = v
    return col


def records_to_columns(records: Sequence[Any]) -> Columns:
    """Stacks Grain records into named columns; every record must have the same fields."""
    flat = [flatten_record(r) for r in records]
    if not flat:
        return {}
    names = list(flat[0])
    for i, f in enumerate(flat):
        if f.keys() != flat[0].keys():
            raise DecodeError(f"record {i} of a batch has fields {sorted(f)} but record 0 has "
                              f"{sorted(names)}; every record must have the same structure.")
    return {n: stack_leaves([f[n] for f in flat]) for n in names}


def _object_column(values: Sequence[Any]) -> np.ndarray:
    col = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        col[i] = v
    return col


def records_of(cols: Columns) -> list[Any]:
    """The records a Grain transform receives: the raw objects, or dict rows of a columnar source."""
    if RECORD in cols:
        return list(cols[RECORD])
    if not cols:
        return []
    n = len(next(iter(cols.values())))
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def unflatten_columns(cols: Columns) -> Any:
    """Columns back to Grain's batch structure: dicts, tuples (digit keys 0..n-1) or a bare array."""
    if list(cols) == [VALUE]:
        return cols[VALUE]
    tree: dict[str, Any] = {}
    for name, col in cols.items():
        node = tree
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = col

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        keys = list(node)
        if sorted(keys) == [str(i) for i in range(len(keys))]:
            return tuple(build(node[str(i)]) for i in range(len(keys)))
        return {k: build(v) for k, v in node.items()}

    return build(tree)


def grain_batch_columns(batch: Any) -> Columns:
    """A batch produced by real Grain as Zephon columns (S/U arrays become exact object arrays)."""
    leaves: dict[str, Any] = {}
    _flatten(batch, "", leaves)
    out: Columns = {}
    for name, v in leaves.items():
        a = np.asarray(v)
        out[name] = a.astype(object) if a.dtype.kind in "SU" else a
    return out


# --- sources -----------------------------------------------------------------------------------

class GrainSource:
    """A Grain random-access data source as a Zephon `RecordSource`.

    Anything with `__len__` and `__getitem__` works (`grain.sources.ArrayRecordDataSource`,
    `RangeDataSource`, `SharedMemoryDataSource` alias `grain.python.InMemoryDataSource`, your own
    class, a list, an array); `__getitems__` is used when
    present so ArrayRecord reads a whole batch in one parallel call. Records are returned as-is
    in the `RECORD` object column (see the module doc).
    """

    def __init__(self, source: Any) -> None:
        if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
            raise PlanError(f"{type(source).__name__} is not a random-access data source; it needs "
                            "__len__ and __getitem__ (e.g. grain.sources.ArrayRecordDataSource).")
        self.source = source
        self._len = len(source)
        self._what = f"GrainSource({type(source).__name__})"
        self._getitems = getattr(source, "__getitems__", None)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"GrainSource({self.source!r})"

    def read(self, indices: np.ndarray) -> Columns:
        keys = as_indices(indices, self._len, self._what).tolist()
        recs = self._getitems(keys) if self._getitems is not None else [self.source[k] for k in keys]
        if len(recs) != len(keys):
            raise DecodeError(f"{self._what}.__getitems__ returned {len(recs)} records for "
                              f"{len(keys)} keys; it must return one record per key.")
        return {RECORD: _object_column(recs)}


class RecordsOf:
    """A columnar Zephon source whose rows are handed out as dict records (for mixing)."""

    def __init__(self, source: RecordSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"RecordsOf({self.source!r})"

    def read(self, indices: np.ndarray) -> Columns:
        return {RECORD: _object_column(records_of(self.source.read(indices)))}


def _is_zephon_source(src: Any) -> bool:
    return callable(getattr(src, "read", None)) and hasattr(src, "__len__") and not hasattr(
        src, "__getitem__")


# --- transforms --------------------------------------------------------------------------------

def _callable_name(t: Any) -> str:
    """Stable name of a function (its qualname) or transform object (its class): part of the
    loader state's identity, so it must not contain addresses."""
    return getattr(t, "__qualname__", None) or type(t).__qualname__


def _with_records(cols: Columns, records: Sequence[Any]) -> Columns:
    out = {RECORD: _object_column(records)}
    if RNG in cols:
        out[RNG] = cols[RNG]
    return out


def _run(fn: Callable[..., Any], what: str, refs: Refs, i: int, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - re-raised naming the record
        raise DecodeError(f"{what} failed on record {int(refs.record[i])} of source "
                          f"{int(refs.source[i])} (epoch {int(refs.epoch[i])}): {e!r}. Fix the "
                          "transform or the record; nothing was skipped.") from e


def _tag_values(refs: Refs, tag: int, what: str) -> np.ndarray:
    if not isinstance(refs, IndexedRefs) or tag not in refs.index:
        raise PlanError(f"{what} needs each element's Grain index, which only plans built by "
                        "zephon.compat.grain carry (a GrainIndex node); build the pipeline with "
                        "Dataset/DataLoader from zephon.compat.grain.")
    return refs.index[tag]


@dataclass(frozen=True)
class GrainMap(Transform):
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
        return _with_records(cols, [_run(fn, what, refs, i, r) for i, r in enumerate(records_of(cols))]), None


@dataclass(frozen=True)
class GrainMapWithIndex(Transform):
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
        return _with_records(cols, [_run(fn, self.name, refs, i, int(index[i]), r)
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
class GrainRandomMap(Transform):
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
        out = _with_records(cols, [_run(fn, self.name, refs, i, r, g)
                                   for i, (r, g) in enumerate(zip(records_of(cols), rngs))])
        if self.rng == "sampler":
            out[RNG] = _object_column(rngs)
        return out, None


@dataclass(frozen=True)
class GrainFilter(Transform):
    """`grain.transforms.Filter` (or a predicate): keeps records where it returns True."""

    transform: Any
    one_to_one = False

    @property
    def name(self) -> str:
        return f"grain.Filter({_callable_name(self.transform)})"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray]:
        fn = self.transform.filter if isinstance(self.transform, grain.transforms.Filter) else self.transform
        recs = records_of(cols)
        keep = np.fromiter((bool(_run(fn, self.name, refs, i, r)) for i, r in enumerate(recs)),
                           dtype=bool, count=len(recs))
        return cols, keep


@dataclass(frozen=True)
class Branches(Transform):
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
        return "Branches[" + "; ".join(f"{list(ids)}: " + ",".join(t.name for t in chain)
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
class Collate(Transform):
    """Stacks the Grain records of a batch into columns (the last transform of a pipeline)."""

    @property
    def name(self) -> str:
        return "grain.Collate"

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        if RECORD not in cols:
            return cols, None
        return records_to_columns(list(cols[RECORD])), None


def collate(cols: Columns) -> Columns:
    """Grain records of a step -> named columns (no-op for columnar data); drops `RNG`."""
    if RECORD in cols:
        return records_to_columns(list(cols[RECORD]))
    return {k: v for k, v in cols.items() if k != RNG}


def with_collate(chain: tuple[Any, ...]) -> tuple[Any, ...]:
    """Appends `Collate` to a one-to-one chain, where it runs inside the runner's workers.

    A chain with a filter is collated by `CollatingLoader` once the step's rows are assembled
    instead: the loader evaluates such chains in several passes, and a pass whose rows are all
    filtered out has no records to learn the column names from. A chain with a packing step
    (an accumulator) gets `Collate` after it, where it only acts if Grain maps follow the pack.
    """
    if _has_accumulator(chain) or all(t.one_to_one for t in chain):
        return chain + (Collate(),)
    return chain


def _has_accumulator(chain: Sequence[Any]) -> bool:
    return any(isinstance(t, Accumulator) for t in chain)


# --- Zephon lane operators and packing in a Grain-shaped pipeline ----------------------------------

_GRAIN_ADAPTERS: tuple[type, ...] = ()  # set below: compat's own transforms pass through as-is


def _is_lane_op(t: Any) -> bool:
    """A Zephon row operator (Tokenize, zephon.Map/Filter/FlatMap/RandomMap, any Transform)."""
    return isinstance(t, Transform) and not isinstance(t, _GRAIN_ADAPTERS)


@dataclass(frozen=True, eq=False)
class LaneOp(Transform):
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


def _pack_fields(length_struct: Any) -> tuple[tuple[str, ...], int]:
    """Grain's `length_struct` -> (packed feature names, seq_len)."""
    def length(v: Any, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 2:
            raise PlanError(f"length_struct{where} must be an integer sequence length >= 2, got {v!r}")
        return int(v)

    if isinstance(length_struct, Mapping):
        if not length_struct:
            raise PlanError("length_struct is empty; give {feature: seq_len} of the token feature")
        lens = {}
        for k, v in length_struct.items():
            if not isinstance(k, str) or not k:
                raise PlanError(f"length_struct keys are feature names (str), got {k!r}")
            if isinstance(v, Mapping):
                raise PlanError(f"length_struct[{k!r}] is nested; Zephon packs flat features "
                                "(top-level dict keys of the records).")
            lens[k] = length(v, f"[{k!r}]")
        if len(set(lens.values())) > 1:
            raise PlanError(f"length_struct gives different lengths {lens}; Zephon packs one token "
                            "sequence per document into rows of one seq_len (targets are derived "
                            "from it), so every packed feature has the same length.")
        return tuple(lens), next(iter(lens.values()))
    return (VALUE,), length(length_struct, "")


@dataclass(frozen=True)
class PackInput(Transform):
    """The documents a packing step packs: feature `fields[0]` of each record as a 1-D token
    array (a scalar is a length-1 sequence, as in Grain), in an object column of that name.

    Further features of `length_struct` (MaxText's `targets` copy of `inputs`) must hold the
    same tokens: Zephon packs one sequence per document and derives next-token targets from
    it, so a record whose features differ is refused, naming it. Other fields are dropped
    (packing emits only its own fields, as Grain's packers do without meta features).
    """

    fields: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"grain.PackInput({','.join(self.fields)})"

    def config(self) -> dict[str, Any]:
        return {"fields": list(self.fields)}

    def _tokens(self, v: Any, refs: Refs, i: int, key: str) -> np.ndarray:
        a = np.asarray(v)
        if a.ndim > 1 or a.dtype.kind not in "iub":
            raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])}: feature "
                              f"{key!r} is {a.dtype}{list(a.shape)}, not a 1-D sequence of token ids; "
                              "packing needs integer token sequences (tokenize first).")
        return a.reshape(-1)

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        key = self.fields[0]
        if not len(refs):
            return {key: np.empty(0, dtype=object)}, None
        if RECORD in cols:
            rows = [flatten_record(r) for r in cols[RECORD]]
        else:
            rows = [{k: cols[k][i] for k in self.fields if k in cols} for i in range(len(refs))]
        out = np.empty(len(rows), dtype=object)
        for i, r in enumerate(rows):
            missing = [k for k in self.fields if k not in r]
            if missing:
                raise DecodeError(f"record {int(refs.record[i])} of source {int(refs.source[i])} has no "
                                  f"feature {missing[0]!r} to pack (it has {sorted(r)}); length_struct "
                                  "names the token features of the records.")
            toks = self._tokens(r[key], refs, i, key)
            for other in self.fields[1:]:
                if not np.array_equal(self._tokens(r[other], refs, i, other), toks):
                    raise DecodeError(
                        f"record {int(refs.record[i])} of source {int(refs.source[i])}: packed feature "
                        f"{other!r} differs from {key!r}. Zephon packs one token sequence per document "
                        "and derives next-token targets from it, so the features of length_struct "
                        f"must be copies of one another (MaxText's layout); pack {key!r} alone "
                        f"(length_struct={{{key!r}: seq_len}}).")
            out[i] = toks
        return {key: out}, None


@dataclass(frozen=True)
class GrainPackNames(Transform):
    """Grain's packer output layout from `Pack(names="zephon")` rows: for every feature `k` of
    `length_struct`, `k` (the packed tokens, not shifted), `k_segment_ids` and `k_positions`
    (int32, 0 on padding) — what `grain.experimental` packers emit for copies of one sequence."""

    fields: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"grain.PackNames({','.join(self.fields)})"

    def config(self) -> dict[str, Any]:
        return {"fields": list(self.fields)}

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, None]:
        out: Columns = {}
        for k in self.fields:
            out[k] = cols["tokens"]
        for k in self.fields:
            out[f"{k}_segment_ids"] = cols["segment_ids"]
            out[f"{k}_positions"] = cols["positions"]
        return out, None


_GRAIN_ADAPTERS = (GrainMap, GrainMapWithIndex, GrainRandomMap, GrainFilter, Branches, Collate,
                   LaneOp, PackInput, GrainPackNames)


class CollatingLoader(Loader):
    """A Zephon `Loader` whose batches are always named columns, never Grain record objects."""

    def __next__(self) -> LocalBatch:
        b = super().__next__()
        return replace(b, data=collate(b.data)) if RECORD in b.data or RNG in b.data else b

    def batch(self, step: int) -> LocalBatch:
        b = super().batch(step)
        return replace(b, data=collate(b.data)) if RECORD in b.data or RNG in b.data else b


def _elements(cols: Columns) -> list[Any]:
    """Unbatched output: Grain records (generators of a DataLoader's RandomMaps left behind)."""
    return records_of({k: v for k, v in cols.items() if k != RNG})


# --- the Grain-shaped dataset ---------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class _Op:
    """One node of the Grain-shaped pipeline; mirrors the node Grain would create."""

    kind: str
    parents: tuple["_Op", ...] = ()
    args: Mapping[str, Any] = field(default_factory=dict)

    def default_seed(self) -> int | None:
        """Grain's `_default_seed`: a SeedSequence over (seed, depth) of the nearest `.seed()`s."""
        agg: list[int] = []
        todo: list[tuple[_Op, int]] = [(self, 0)]
        while todo:
            node, depth = todo.pop(0)
            if node.kind == "seed":
                agg.extend((int(node.args["seed"]), depth))
            else:
                todo.extend((p, depth + 1) for p in node.parents)
        if not agg:
            return None
        return int(np.random.SeedSequence(agg).generate_state(1, dtype=np.uint32)[0])

    def upstream(self) -> Iterable["_Op"]:
        yield self
        for p in self.parents:
            yield from p.upstream()


@dataclass(frozen=True)
class _Config:
    order: Order = "grain"
    lanes: int | None = None
    mapping: str = "contiguous"
    rank: int | None = None  # None: not sharded (rank 0 of 1; backends may derive their own)
    world: int | None = None
    runner: Any = None
    read_ahead: int = READ_AHEAD


@dataclass
class _Ctx:
    order: Order
    wrap_columnar: bool
    sources: list[Any] = field(default_factory=list)
    tags: int = 0
    count_field: str = "tokens"  # what a mix by tokens counts (the packed feature, if packing)

    def tag(self) -> int:
        self.tags += 1
        return self.tags - 1


@dataclass(frozen=True)
class _Built:
    node: Node
    chain: tuple[Transform, ...] = ()
    filtered: bool = False
    sources: tuple[int, ...] = ()


_ITER_OPS = ("map", "filter", "random_map", "map_with_index", "to_iter_dataset", "batch", "seed",
             "pack")


def _build(op: _Op, ctx: _Ctx) -> _Built:
    k, a = op.kind, op.args
    if k == "source":
        sid = len(ctx.sources)
        src = a["source"]
        if _is_zephon_source(src):
            ctx.sources.append(RecordsOf(src) if ctx.wrap_columnar else src)
        else:
            ctx.sources.append(GrainSource(src))
        return _Built(Source(len(src), sid, a.get("name", "")), sources=(sid,))
    if k == "batch":
        raise PlanError("`batch` must be the last step of the pipeline: Zephon emits fixed-size "
                        "global batches; move it to the end (map batches inside your step fn).")
    b = _build(op.parents[0], ctx) if k != "mix" else None
    if k in ("seed", "to_iter_dataset"):
        return b  # type: ignore[return-value]
    if k == "shuffle":
        node = GrainShuffle(b.node, a["seed"]) if ctx.order == "grain" else Shuffle(b.node, a["seed"])
        return replace(b, node=node)  # type: ignore[arg-type]
    if k == "repeat":
        return replace(b, node=Repeat(b.node, a["num_epochs"]))  # type: ignore[arg-type, union-attr]
    if k == "slice":
        n = b.node.length  # type: ignore[union-attr]
        start, stop, step = a["slice"].indices(GRAIN_INFINITE if n is None else n)
        if step < 1:
            raise PlanError(f"slice step must be positive for a Zephon plan, got {step}")
        stop = None if n is None and stop >= GRAIN_INFINITE else stop
        return replace(b, node=Slice(b.node, start, stop, step))  # type: ignore[arg-type]
    if k == "mix":
        kids = [_build(p, ctx) for p in op.parents]
        props = grain_proportions(a["weights"], len(kids))
        if a.get("by", "samples") == "tokens":
            node = Mix(tuple(c.node for c in kids), tuple(float(p) for p in props), by="tokens",
                       count_field=a.get("count_field") or ctx.count_field)
        elif ctx.order == "grain":
            node: Node = GrainMix(tuple(c.node for c in kids), props)
        else:
            if any(isinstance(n, GrainIndex) for c in kids for n in _nodes(c.node)):
                raise PlanError("map_with_index/random_map before mix needs order='grain' (Zephon's "
                                "Mix does not carry Grain indices); apply it after mix instead.")
            node = Mix(tuple(c.node for c in kids), tuple(float(p) for p in props))
        chain: tuple[Transform, ...] = ()
        if any(c.chain for c in kids):
            chain = (Branches(tuple((c.sources, c.chain) for c in kids)),)
        return _Built(node, chain, any(c.filtered for c in kids), tuple(s for c in kids for s in c.sources))
    assert b is not None
    packed = _has_accumulator(b.chain)
    if k in ("map", "filter") and isinstance(a["transform"], Transform):
        t = a["transform"]
        lane_op = LaneOp(t) if _is_lane_op(t) else t  # compat's own adapters pass through
        return replace(b, chain=b.chain + (lane_op,), filtered=b.filtered or not t.one_to_one)
    if k == "map":
        return replace(b, chain=b.chain + (GrainMap(a["transform"]),))
    if k == "filter":
        return replace(b, chain=b.chain + (GrainFilter(a["transform"]),), filtered=True)
    if k == "pack":
        if packed:
            raise PlanError("a pipeline packs once: it already has a packing step (one accumulator "
                            "per lane pipeline).")
        pack: Pack = a["pack"]
        chain = b.chain + (PackInput(a["fields"]), pack)
        if a.get("names") == "grain":
            chain += (GrainPackNames(a["fields"]),)
        return replace(b, chain=chain)
    if packed and k in ("random_map", "map_with_index") and ctx.order == "grain":
        raise PlanError(f"{k} after a packing step: packed rows have no Grain index; apply it "
                        "before packing, or use order='zephon' (a generator per packed row).")
    if k in ("random_map", "map_with_index"):
        if a.get("iter") and b.filtered and ctx.order == "grain":
            raise PlanError(f"{k} after to_iter_dataset() numbers elements by how many survived "
                            "earlier filters, which Zephon's lanes cannot reproduce; apply it before "
                            "the filter (or before to_iter_dataset()), or use order='zephon'.")
        if k == "random_map" and ctx.order != "grain":
            return replace(b, chain=b.chain + (GrainRandomMap(a["transform"], a["seed"], "record"),))
        tag = ctx.tag()
        t: Transform = (GrainRandomMap(a["transform"], a["seed"], "dataset", tag) if k == "random_map"
                        else GrainMapWithIndex(a["transform"], tag))
        return replace(b, node=GrainIndex(b.node, tag), chain=b.chain + (t,))
    raise PlanError(f"unknown pipeline step {k!r}")


def _nodes(node: Node) -> Iterable[Node]:
    yield node
    for c in getattr(node, "children", None) or ((node.child,) if hasattr(node, "child") else ()):
        yield from _nodes(c)


class Dataset:
    """A Grain-shaped pipeline (`MapDataset` spellings) that runs on Zephon.

    Build it exactly like a `grain.MapDataset`; `order="grain"` (default) reproduces Grain's
    records and batches, `order="zephon"` uses Zephon's own shuffle/mix (a Feistel permutation
    and a periodic interleave; faster to resolve, different order). Zephon's own knobs:
    `lanes(L)` (canonical lanes, the unit of state and ownership), `shard(rank, world)`
    (data-parallel rank; rows of the global batch, not a slice of the data) and `runner(r)`.
    """

    def __init__(self, op: _Op, config: _Config = _Config()) -> None:
        self._op = op
        self._config = config

    # --- Grain constructors -------------------------------------------------------------------
    @classmethod
    def source(cls, source: Any, *, order: Order = "grain", name: str = "") -> "Dataset":
        """Wraps a Grain data source, a sequence, or a Zephon `RecordSource`."""
        if order not in ("grain", "zephon"):
            raise PlanError(f"order must be 'grain' or 'zephon', got {order!r}")
        return cls(_Op("source", (), {"source": source, "name": name}), _Config(order=order))

    @classmethod
    def range(cls, start: int, stop: int | None = None, step: int = 1, *,
              order: Order = "grain") -> "Dataset":
        """`MapDataset.range`: the integers of Python's `range(start, stop, step)`."""
        r = range(start) if stop is None else range(start, stop, step)
        return cls.source(r, order=order, name=f"range({r.start}, {r.stop}, {r.step})")

    @classmethod
    def mix(cls, datasets: Sequence["Dataset"], weights: Sequence[float] | None = None, *,
            by: str = "samples", count_field: str | None = None) -> "Dataset":
        """`MapDataset.mix`: Grain's deterministic proportional interleave of `datasets`.

        `by="tokens"` (Zephon): the weights apply to realised tokens, inside every lane — each
        lane takes its next document from the dataset furthest below its share of the tokens
        so far (`zephon.Mix(..., by="tokens")`). Each dataset tokenizes before the mix (e.g.
        `.map(Tokenize(...))`); what is counted is the length of column `count_field` (default:
        the feature a later packing step packs, else `tokens`). Such a mix is the last ordering
        step (shuffle/repeat each dataset before it) and has no random access.
        """
        if by not in ("samples", "tokens"):
            raise PlanError(f"mix(by=...) must be 'samples' or 'tokens', got {by!r}")
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
                        "count_field": count_field}), datasets[0]._config)

    # --- Grain transformations ------------------------------------------------------------------
    def _then(self, kind: str, **args: Any) -> "Dataset":
        self._check_open(kind)
        return Dataset(_Op(kind, (self._op,), args), self._config)

    def _check_open(self, kind: str) -> None:
        if self._op.kind == "batch" and kind != "to_iter_dataset":
            raise PlanError(f"cannot {kind} after batch: Zephon's plan ends in the global batch; "
                            "apply the step before batch().")
        if self._in_iter() and kind not in _ITER_OPS:
            raise PlanError(f"{kind} is a MapDataset step and cannot follow to_iter_dataset() or a "
                            "packing step; move it before them (as in Grain).")

    def _in_iter(self) -> bool:
        return any(o.kind in ("to_iter_dataset", "pack") for o in self._op.upstream())

    @property
    def packed(self) -> bool:
        """Whether the pipeline packs (its rows are packed sequences, counted by tokens)."""
        return any(o.kind == "pack" for o in self._op.upstream())

    @property
    def _token_mixed(self) -> bool:
        return any(o.kind == "mix" and o.args.get("by") == "tokens" for o in self._op.upstream())

    def _seed_for(self, kind: str, seed: int | None) -> int | None:
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 32:
                raise PlanError(f"{kind} seeds are integers in [0, 2**32), got {seed!r}")
            return int(seed)
        return _Op(kind, (self._op,)).default_seed()

    def seed(self, seed: int) -> "Dataset":
        """`ds.seed(s)`: downstream shuffles/random maps derive their seeds as Grain does."""
        return self._then("seed", seed=int(seed))

    def shuffle(self, seed: int | None = None) -> "Dataset":
        s = self._seed_for("shuffle", seed)
        if s is None:
            raise PlanError("`shuffle` requires a seed. Please provide it with `ds.seed(seed)` or "
                            "shuffle(seed=...).")
        return self._then("shuffle", seed=s)

    def repeat(self, num_epochs: int | None = None, *, reseed_each_epoch: bool = True) -> "Dataset":
        if not reseed_each_epoch:
            raise PlanError("repeat(reseed_each_epoch=False) is not supported: Zephon re-keys every "
                            "epoch; repeat with a new shuffle per epoch (the default).")
        return self._then("repeat", num_epochs=num_epochs)

    def slice(self, sl: slice) -> "Dataset":
        return self._then("slice", slice=sl)

    def map(self, transform: Any) -> "Dataset":
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

    def filter(self, transform: Any) -> "Dataset":
        return self._then("filter", transform=transform, iter=self._in_iter())

    def pack(self, length_struct: Any, mode: str = "concat", *, num_packing_bins: int = 8,
             padding_struct: Any = None, max_sequences_per_bin: int | None = None,
             names: str = "maxtext", _grain: Any = None) -> "Dataset":
        """Packs token sequences into rows (Zephon's `Pack` on every lane; see the module doc).

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
        fields, seq_len = _pack_fields(length_struct)
        if names not in ("maxtext", "grain", "zephon"):
            raise PlanError(f"names must be 'maxtext', 'grain' or 'zephon', got {names!r}")
        pad = 0
        if padding_struct is not None:
            vals = ({padding_struct[k] for k in fields if k in padding_struct}
                    if isinstance(padding_struct, Mapping) else {padding_struct})
            if len(vals) > 1 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                    for v in vals):
                raise PlanError(f"padding_struct {padding_struct!r}: Zephon pads every packed "
                                "feature with one integer id; give the same id for each.")
            pad = int(next(iter(vals))) if vals else 0
        fit = mode != "concat"
        pack = Pack(seq_len, mode, field=fields[0],  # type: ignore[arg-type]
                    max_open_bins=int(num_packing_bins) if fit else 8, pad_id=pad,
                    max_segments=max_sequences_per_bin if fit else None,
                    names="zephon" if names == "grain" else names)  # type: ignore[arg-type]
        return self._then("pack", pack=pack, fields=fields, names=names, grain=_grain)

    def random_map(self, transform: Any, *, seed: int | None = None) -> "Dataset":
        s = self._seed_for("random_map", seed)
        if s is None:
            raise PlanError("`random_map` requires a seed. Please either provide it with "
                            "`ds.seed(seed)` before any random transformations or pass it directly "
                            "with `ds.random_map(transform, seed=seed)`.")
        return self._then("random_map", transform=transform, seed=s, iter=self._in_iter())

    def map_with_index(self, transform: Any) -> "Dataset":
        return self._then("map_with_index", transform=transform, iter=self._in_iter())

    def batch(self, batch_size: int, *, drop_remainder: bool = False,
              batch_fn: Callable[[Sequence[Any]], Any] | None = None) -> "Dataset":
        """The global batch. Zephon emits full batches only (as with drop_remainder=True)."""
        if batch_fn is not None:
            raise PlanError("batch_fn is not supported: Zephon stacks records into columns itself; "
                            "pad or pack records with map() before batch().")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise PlanError(f"batch_size must be a positive integer, got {batch_size!r}")
        return self._then("batch", batch_size=int(batch_size), drop_remainder=bool(drop_remainder))

    def to_iter_dataset(self, read_options: Any = None, *, allow_nones: bool = False) -> "Dataset":
        """Grain's switch to `IterDataset`; kept so pipelines read the same (Zephon needs no
        read threads here: runners parallelise whole steps)."""
        if allow_nones:
            raise PlanError("to_iter_dataset(allow_nones=True) is not supported; Zephon never "
                            "emits filtered-out elements.")
        return self._then("to_iter_dataset")

    def apply(self, transformations: Any) -> "Dataset":
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

    def __getitem__(self, index: int | slice) -> Any:
        """A slice gives a sliced dataset; an int the element (or batch) there, as in Grain."""
        if isinstance(index, slice):
            return self.slice(index)
        return self._item(int(index))

    # --- Zephon knobs ---------------------------------------------------------------------------
    def lanes(self, count: int, mapping: str = "contiguous") -> "Dataset":
        """Canonical lanes: fix this for runs that restore at another data-parallel degree."""
        return Dataset(self._op, replace(self._config, lanes=int(count), mapping=mapping))

    def shard(self, rank: int, world: int) -> "Dataset":
        """Data-parallel rank `rank` of `world`: iterates its rows of every global batch."""
        return Dataset(self._op, replace(self._config, rank=int(rank), world=int(world)))

    def runner(self, runner: Any) -> "Dataset":
        """Executes steps with a Zephon runner (threads/processes); changes speed, never data."""
        return Dataset(self._op, replace(self._config, runner=runner))

    def read_ahead(self, rows: int) -> "Dataset":
        """Rows read and transformed ahead in one group (default `READ_AHEAD`); speed only."""
        return Dataset(self._op, replace(self._config, read_ahead=int(rows)))

    # --- the plan -------------------------------------------------------------------------------
    @property
    def batched(self) -> bool:
        return any(o.kind == "batch" for o in self._op.upstream())

    @functools.cached_property
    def _compiled(self) -> "_Compiled":
        op = self._op
        while op.kind == "to_iter_dataset" and op.parents and op.parents[0].kind == "batch":
            op = op.parents[0]
        batched = op.kind == "batch"
        size, drop = (op.args["batch_size"], op.args["drop_remainder"]) if batched else (None, True)
        stream_op = op.parents[0] if op.kind == "batch" else op
        leaves = sum(1 for o in stream_op.upstream() if o.kind == "source")
        sample_mix = any(o.kind == "mix" and o.args.get("by", "samples") == "samples"
                         for o in stream_op.upstream())
        ctx = _Ctx(self._config.order, wrap_columnar=leaves > 1 and sample_mix)
        packs = [o for o in stream_op.upstream() if o.kind == "pack"]
        if packs:
            ctx.count_field = packs[0].args["fields"][0]
        built = _build(stream_op, ctx)
        token_mix = any(isinstance(n, Mix) and n.by == "tokens" for n in _nodes(built.node))
        if token_mix and not (isinstance(built.node, Mix) and built.node.by == "tokens"):
            raise PlanError("a mix by tokens runs inside every lane, so it must be the last ordering "
                            "step of the pipeline: shuffle/repeat/slice each dataset before mix(), "
                            "and apply map_with_index/random_map (Grain-indexed) before it too.")
        lane_engine = token_mix or _has_accumulator(built.chain)
        lanes = self._config.lanes or self._config.world or 1
        rows = size if size is not None else lanes
        if rows % lanes:
            raise PlanError(f"batch size {rows} is not divisible by lanes={lanes}; choose a lane "
                            f"count that divides the batch (e.g. lanes({_largest_divisor(rows, lanes)})).")
        n = built.node.length
        if size is not None and n is not None and n % size and not drop and not lane_engine:
            log.warning("the stream has %d elements, not a multiple of batch size %d: Zephon emits "
                        "full global batches only, so the last %d elements are not emitted (Grain "
                        "would emit a smaller final batch).", n, size, n % size)
        if built.filtered and lanes > 1 and self._config.order == "grain" and not lane_engine:
            log.warning("with a filter and lanes=%d each lane filters its own input, so batches "
                        "differ from Grain's (which fills one batch from the whole stream); use "
                        "lanes=1 to compare with Grain.", lanes)
        stream = built.node
        if self._config.order == "grain" and lanes > 1 and not lane_engine:
            # each lane's rows of a step are consecutive Grain elements (Grain's batches); a
            # packing or token-mixed lane consumes documents at its own pace, so it just reads
            # its share of the Grain-ordered stream
            stream = ContiguousBatches(stream, lanes, rows // lanes)
        plan = stream.lanes(lanes, self._config.mapping).batch(rows)  # type: ignore[attr-defined]
        transforms = with_collate(built.chain) if size is not None else built.chain
        return _Compiled(plan, built.node, dict(enumerate(ctx.sources)), transforms)

    @property
    def plan(self) -> Batch:
        """The Zephon plan (JSON-serialisable; see `plan.explain(step)`)."""
        return self._compiled.plan

    @property
    def transforms(self) -> tuple[Transform, ...]:
        return self._compiled.transforms

    @property
    def record_sources(self) -> dict[int, Any]:
        return self._compiled.sources

    def loader(self, *, rank: int | None = None, world: int | None = None, start_step: int = 0) -> Loader:
        """The Zephon `Loader` of rank `rank` (default: the dataset's `shard`)."""
        c = self._compiled
        cls = CollatingLoader if self.batched else Loader
        return cls(c.plan, c.sources, c.transforms, rank=rank if rank is not None else self._config.rank or 0,
                   world=world if world is not None else self._config.world or 1,
                   runner=self._config.runner, start_step=start_step, read_ahead=self._config.read_ahead)

    def _check_backend(self, what: str) -> _Compiled:
        c = self._compiled
        if not self.batched:
            raise PlanError(f"{what} emits global batches; add .batch(B) to the pipeline.")
        if not _has_accumulator(c.transforms) and not all(t.one_to_one for t in c.transforms):
            raise PlanError(f"{what} with a filter is not available yet: the backend's loader "
                            "cannot stack Grain records for steps evaluated in several passes. "
                            "Iterate the dataset (numpy batches) or filter with a Map that marks "
                            "records instead.")
        return c

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
        if self._config.world is not None:
            kwargs.setdefault("rank", self._config.rank)
            kwargs.setdefault("world", self._config.world)
        return TorchLoader(c.plan, c.sources, c.transforms, runner=self._config.runner, **kwargs)

    def to_torch_dataset(self, **kwargs: Any) -> Any:
        """A `zephon.backends.torch.ZephonIterableDataset` over this pipeline, for
        `ZephonDataLoader(dataset, num_workers=...)` (`shard()` gives rank/world; otherwise
        torch.distributed's)."""
        from zephon.backends.torch import ZephonIterableDataset
        c = self._check_backend("to_torch_dataset")
        if self._config.world is not None:
            kwargs.setdefault("rank", self._config.rank)
            kwargs.setdefault("world", self._config.world)
        return ZephonIterableDataset(c.plan, c.sources, c.transforms, runner=self._config.runner, **kwargs)

    def __iter__(self) -> "Iterator":
        return Iterator(self.loader(), batched=self.batched)

    def __len__(self) -> int:
        if self.packed or self._token_mixed:
            raise TypeError("a packed or token-mixed pipeline has no length: how many rows it makes "
                            "depends on the documents' token counts (like Grain's IterDataset).")
        n = self.plan.num_steps if self.batched else self._compiled.stream.length
        return GRAIN_INFINITE if n is None else int(n)

    def _item(self, index: int) -> Any:
        if self.packed or self._token_mixed:
            raise PlanError(f"ds[{index}]: a packed or token-mixed pipeline has no random access "
                            "(where a row starts depends on every document before it); iterate it.")
        if index < 0:
            index += len(self)
        if self.batched:
            return Iterator.emit(self.loader().batch(index), batched=True)
        c = self._compiled
        refs = c.stream.resolve([index])
        cols, kept = run_transforms(c.transforms, read_refs(c.sources, refs), refs, 0)
        return _elements(cols)[0] if len(kept) else None

    def fingerprints(self, steps: int, *, world: int | None = None) -> list[str]:
        """Step fingerprints of the first `steps` global batches, computed by `world` ranks."""
        world = world or self._config.world or 1
        return run_fingerprints([self.loader(rank=r, world=world) for r in range(world)], steps)

    # --- the same pipeline on real Grain -------------------------------------------------------
    def to_grain(self) -> Any:
        """The equivalent real `grain.MapDataset`/`IterDataset` (same ops, seeds and sources)."""
        return _to_grain(self._op, {})


@dataclass(frozen=True)
class _Compiled:
    plan: Batch
    stream: Node  # the Grain-ordered element stream (before lanes are dealt)
    sources: dict[int, Any]
    transforms: tuple[Transform, ...]


def _largest_divisor(n: int, upto: int) -> int:
    return max(d for d in range(1, upto + 1) if n % d == 0)


def _to_grain(op: _Op, memo: dict[int, Any]) -> Any:
    if id(op) in memo:
        return memo[id(op)]
    k, a = op.kind, op.args
    if k == "source":
        src = a["source"]
        if _is_zephon_source(src):
            raise PlanError("to_grain() needs Grain data sources; a Zephon RecordSource has no "
                            "Grain equivalent.")
        ds = grain.MapDataset.range(src.start, src.stop, src.step) if isinstance(src, range) else (
            grain.MapDataset.source(src))
    elif k == "mix":
        if a.get("by", "samples") != "samples":
            raise PlanError("to_grain(): Grain has no mix by tokens.")
        ds = grain.MapDataset.mix([_to_grain(p, memo) for p in op.parents], a["weights"])
    else:
        p = _to_grain(op.parents[0], memo)
        if k == "seed":
            ds = p.seed(a["seed"])
        elif k == "shuffle":
            ds = p.shuffle(seed=a["seed"])
        elif k == "repeat":
            ds = p.repeat(a["num_epochs"])
        elif k == "slice":
            ds = p.slice(a["slice"])
        elif k in ("map", "filter") and isinstance(a["transform"], Transform):
            raise PlanError(f"to_grain(): the Zephon operator {a['transform'].op_name} has no Grain "
                            "equivalent (tokenize with a Grain map to compare with Grain).")
        elif k == "map":
            ds = p.map(a["transform"])
        elif k == "filter":
            ds = p.filter(a["transform"])
        elif k == "pack":
            if a.get("grain") is None:
                raise PlanError("to_grain(): a zephon Pack given to map() has no Grain equivalent; "
                                "spell the packing step with zephon.compat.grain.experimental's "
                                "Grain packers.")
            cls_name, kwargs = a["grain"]
            if isinstance(p, grain.MapDataset):
                p = p.to_iter_dataset()
            ds = getattr(grain.experimental, cls_name)(p, **kwargs)
        elif k == "random_map":
            ds = p.random_map(a["transform"], seed=a["seed"])
        elif k == "map_with_index":
            ds = p.map_with_index(a["transform"])
        elif k == "to_iter_dataset":
            ds = p.to_iter_dataset()
        elif k == "batch":
            if isinstance(p, grain.MapDataset) and any(o.kind == "filter" for o in op.upstream()):
                p = p.to_iter_dataset()  # Grain requires this after filter; same elements
            ds = p.batch(a["batch_size"], drop_remainder=a["drop_remainder"])
        else:
            raise PlanError(f"no Grain equivalent for step {k!r}")
    memo[id(op)] = ds
    return ds


# --- Grain's packing datasets ----------------------------------------------------------------

def _bos_handling_none(bos_handling: Any) -> bool:
    return bos_handling is None or bos_handling == grain.experimental.BOSHandling.DO_NOTHING


def _check_parent(parent: Any, cls: str) -> None:
    if not isinstance(parent, Dataset):
        raise PlanError(f"{cls} packs a zephon.compat.grain Dataset, got {type(parent).__name__}; "
                        "build the pipeline with zg.Dataset (a real Grain dataset takes "
                        f"grain.experimental.{cls}).")


def _refuse(what: str, value: Any, why: str) -> None:
    raise PlanError(f"{what}={value!r} is not supported by Zephon's packing: {why}")


def _fit_args(length_struct: Any, num_packing_bins: int, seed: int, shuffle_bins: bool,
              shuffle_bins_group_by_feature: str | None, meta_features: Sequence[str],
              pack_alignment_struct: Any, padding_struct: Any,
              max_sequences_per_bin: int | None) -> dict[str, Any]:
    if isinstance(num_packing_bins, bool) or not isinstance(num_packing_bins, (int, np.integer)) \
            or num_packing_bins < 1:
        raise PlanError(f"num_packing_bins must be a positive integer, got {num_packing_bins!r}")
    if meta_features:
        _refuse("meta_features", meta_features, "it packs token features only; drop or pack the "
                "other features before the packing step.")
    if pack_alignment_struct is not None:
        _refuse("pack_alignment_struct", pack_alignment_struct, "segments start right after "
                "one another.")
    if shuffle_bins_group_by_feature is not None:
        _refuse("shuffle_bins_group_by_feature", shuffle_bins_group_by_feature, "rows are emitted "
                "in the order they close (deterministic per lane); there is no bin shuffle.")
    return dict(length_struct=length_struct, num_packing_bins=int(num_packing_bins), seed=seed,
                shuffle_bins=shuffle_bins, shuffle_bins_group_by_feature=None, meta_features=(),
                pack_alignment_struct=None, padding_struct=padding_struct,
                max_sequences_per_bin=max_sequences_per_bin)


class ConcatThenSplitIterDataset(Dataset):
    """`grain.experimental.ConcatThenSplitIterDataset` on Zephon: concat-then-split packing.

    Same arguments as Grain's; runs `zephon.ops.pack.Pack(seq_len, "concat")` in every lane
    (documents laid end to end and cut every seq_len tokens; a document crossing a row boundary
    continues in the lane's next row — across steps and resumes; no token lost, no padding).
    With `lanes(1)` the rows are Grain's rows (`names="grain"` gives Grain's fields too); with
    L lanes each lane packs its own share of the stream. `names`: see `Dataset.pack`.
    Unsupported (refused): meta features, `split_full_length_features=False`, BOS replacement
    (add BOS with `Tokenize(bos=...)` instead: replacing a token loses it).
    """

    def __init__(self, parent: Dataset, *, length_struct: Mapping[str, int],
                 meta_features: Sequence[str] = (), split_full_length_features: bool = True,
                 bos_handling: Any = None, bos_features: Sequence[str] = (),
                 bos_token_id: int | None = None, names: str = "maxtext") -> None:
        _check_parent(parent, "ConcatThenSplitIterDataset")
        if meta_features:
            _refuse("meta_features", meta_features, "it packs token features only; drop or pack "
                    "the other features before the packing step.")
        if not split_full_length_features:
            _refuse("split_full_length_features", False, "full-length documents are packed in "
                    "stream order like any other (Grain passes them ahead of the buffer).")
        if not _bos_handling_none(bos_handling) or bos_features or bos_token_id is not None:
            _refuse("bos_handling", bos_handling, "replacing each piece's first token with BOS "
                    "drops that token; add BOS to every document with Tokenize(bos=...).")
        kwargs = dict(length_struct=length_struct, meta_features=(),
                      split_full_length_features=True)
        ds = parent.pack(length_struct, "concat", names=names,
                         _grain=("ConcatThenSplitIterDataset", kwargs))
        super().__init__(ds._op, ds._config)


class FirstFitPackIterDataset(Dataset):
    """`grain.experimental.FirstFitPackIterDataset` on Zephon: first-fit packing.

    Same arguments as Grain's; runs `Pack(seq_len, "first_fit", max_open_bins=num_packing_bins,
    max_segments=max_sequences_per_bin)` in every lane. Zephon keeps up to `num_packing_bins`
    rows open and emits the oldest when a document fits none (Grain emits all its bins then),
    and splits documents longer than seq_len (Grain raises on them), so rows differ from Grain's
    while padding is comparable. `seed`/`shuffle_bins` only reorder Grain's emitted bins: Zephon
    emits rows in the order they close. `names`: see `Dataset.pack`.
    """

    _mode = "first_fit"
    _grain_name = "FirstFitPackIterDataset"

    def __init__(self, parent: Dataset, *, length_struct: Any, num_packing_bins: int,
                 seed: int = 0, shuffle_bins: bool = True,
                 shuffle_bins_group_by_feature: str | None = None, meta_features: Sequence[str] = (),
                 pack_alignment_struct: Any = None, padding_struct: Any = None,
                 max_sequences_per_bin: int | None = None, names: str = "maxtext") -> None:
        _check_parent(parent, self._grain_name)
        kwargs = _fit_args(length_struct, num_packing_bins, seed, shuffle_bins,
                           shuffle_bins_group_by_feature, meta_features, pack_alignment_struct,
                           padding_struct, max_sequences_per_bin)
        ds = parent.pack(length_struct, self._mode, num_packing_bins=int(num_packing_bins),
                         padding_struct=padding_struct, max_sequences_per_bin=max_sequences_per_bin,
                         names=names, _grain=(self._grain_name, kwargs))
        super().__init__(ds._op, ds._config)


class BestFitPackIterDataset(FirstFitPackIterDataset):
    """`grain.experimental.BestFitPackIterDataset` on Zephon: best-fit packing (each document
    goes to the open row it fills tightest); otherwise as `FirstFitPackIterDataset`."""

    _mode = "best_fit"
    _grain_name = "BestFitPackIterDataset"


class _Experimental:
    """`zephon.compat.grain.experimental`: Grain's packing datasets under their Grain names, so
    `grain.experimental.X(ds, ...)` becomes `zg.experimental.X(ds, ...)`."""

    BOSHandling = grain.experimental.BOSHandling
    ConcatThenSplitIterDataset = ConcatThenSplitIterDataset
    FirstFitPackIterDataset = FirstFitPackIterDataset
    BestFitPackIterDataset = BestFitPackIterDataset


experimental = _Experimental()


# --- the iterator ----------------------------------------------------------------------------

class Iterator(grain.DatasetIterator):
    """Iterates a Zephon loader with Grain's iterator API: `get_state()` / `set_state()`.

    It is a `grain.DatasetIterator`, so Grain's Orbax `CheckpointHandler`
    (`grain.checkpoint.CheckpointSave/CheckpointRestore`) and Orbax's StatefulCheckpointable API
    save and restore it like any Grain iterator. The state is Zephon's one JSON state document
    (plan fingerprint, step, lane cursors) that every emitter reads and writes; unbatched
    iteration adds `elements_taken`, the offset inside a step.
    """

    def __init__(self, loader: Loader, *, batched: bool = True) -> None:
        super().__init__()
        self.loader = loader
        self.batched = batched
        self._rows: list[Any] = []
        self._taken = 0
        self._before: dict[str, Any] | None = None

    @staticmethod
    def emit(batch: LocalBatch, *, batched: bool) -> Any:
        if batched:
            return unflatten_columns(batch.data)
        return _elements(batch.data)

    def __next__(self) -> Any:
        self._assert_not_closed()
        if self.batched:
            return self.emit(next(self.loader), batched=True)
        while self._taken >= len(self._rows):
            self._before = self.loader.position()
            self._rows = self.emit(next(self.loader), batched=False)
            self._taken = 0
        self._taken += 1
        return self._rows[self._taken - 1]

    @property
    def step(self) -> int:
        """The next global batch (step) of the underlying loader."""
        return self.loader.step

    def get_state(self) -> dict[str, Any]:
        """Zephon's state document (the one `Loader.state()`, `state_dict()` and
        `JaxLoader.state()` return; any of them restores it). Unbatched iteration stopped inside
        a step adds `"elements_taken"`: the step's elements already returned."""
        if not self.batched and self._taken < len(self._rows):
            return {**self.loader.state_from(self._before), "elements_taken": self._taken}
        return self.loader.state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from a state document of any Zephon emitter (or this iterator's)."""
        if isinstance(state, Mapping) and "loader" in state and "zephon_state" not in state:
            state = {**state["loader"], "elements_taken": state.get("skip", 0)}  # before 0.2
        if not isinstance(state, Mapping):
            raise StateError(f"set_state needs the state document get_state() returned (a dict), "
                             f"got {type(state).__name__}")
        skip = state.get("elements_taken", 0)
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise StateError(f"the state's 'elements_taken' is {skip!r}; expected a non-negative "
                             "integer (elements of the step already returned). The state was edited.")
        self.loader.restore(state)
        self._rows, self._taken = [], 0
        if skip:
            if self.batched:
                raise StateError("this state stopped inside a step (elements_taken="
                                 f"{skip}) of an unbatched iterator; a batched one resumes at step "
                                 "boundaries only. Restore it with an unbatched iterator.")
            self._before = self.loader.position()
            self._rows = self.emit(next(self.loader), batched=False)
            if skip > len(self._rows):
                raise StateError(f"the state's 'elements_taken' is {skip}, but step "
                                 f"{self._before['step']} has {len(self._rows)} elements here; "
                                 "the state was edited or belongs to another pipeline.")
            self._taken = skip

    def close(self) -> None:
        self.loader.close()
        super().close()

    def __str__(self) -> str:
        return f"zephon.compat.grain.Iterator(step={self.loader.step})"


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One iterator state from every rank's `get_state()` taken at the same step (batched
    iteration), restorable by `set_state` at any data-parallel degree of the same pipeline —
    how a packed or token-mixed pipeline (whose lanes each carry their own position) changes D."""
    from zephon.exec.loader import merge_states as merge_loader_states

    if not states:
        raise StateError("merge_states needs at least one iterator state")
    docs = []
    for s in states:
        if isinstance(s, Mapping) and "loader" in s and "zephon_state" not in s:  # before 0.2
            s = {**s["loader"], "elements_taken": s.get("skip", 0)}
        if not isinstance(s, Mapping) or "zephon_state" not in s:
            raise StateError("not a Zephon state document; pass what get_state() returned.")
        if s.get("elements_taken", 0):
            raise StateError("cannot merge states taken inside a step (unbatched iteration, "
                             "elements_taken > 0); take them at a step boundary.")
        docs.append({k: v for k, v in s.items() if k != "elements_taken"})
    return merge_loader_states(docs)


# --- DataLoader + IndexSampler -------------------------------------------------------------------

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
                 runner: Any = None, read_ahead: int = READ_AHEAD) -> None:
        del worker_buffer_size, read_options, enable_profiling  # Grain tuning knobs; no effect on data
        if not isinstance(sampler, grain.samplers.IndexSampler):
            raise PlanError(f"{type(sampler).__name__} is not supported; Grain order is reproduced "
                            "for grain.samplers.IndexSampler.")
        opts = shard_options if shard_options is not None else sampler._shard_options  # noqa: SLF001
        index, count, _ = _shard_tuple(opts)
        s_index, s_count, s_drop = _shard_tuple(sampler._shard_options)  # noqa: SLF001
        if s_count != 1 and (s_count, s_index) != (count, index):
            raise PlanError(f"the sampler is sharded {s_index}/{s_count} but the loader {index}/"
                            f"{count}; give both the same shard options (or NoSharding() to the sampler).")
        self.workers = max(int(worker_count or 0), 1)
        self.grain_args = dict(data_source=data_source, sampler=sampler, operations=list(operations),
                               worker_count=worker_count, shard_options=opts)
        batch, transforms, filtered, tag = None, [], False, None
        for i, t in enumerate(operations):
            if isinstance(t, grain.transforms.Batch):
                if i != len(operations) - 1:
                    raise PlanError("Batch must be the last operation: Zephon's plan ends in the "
                                    "global batch.")
                if t.batch_fn is not None:
                    raise PlanError("Batch(batch_fn=...) is not supported; pad/pack with a Map first.")
                batch = t
            elif isinstance(t, grain.transforms.Map):
                transforms.append(GrainMap(t))
            elif isinstance(t, grain.transforms.Filter):
                transforms.append(GrainFilter(t))
                filtered = True
            elif isinstance(t, grain.transforms.RandomMap):
                tag = 0
                transforms.append(GrainRandomMap(t, sampler._seed, "sampler", tag))  # noqa: SLF001
            else:
                raise PlanError(f"{type(t).__name__} is not supported by grain.DataLoader's Zephon "
                                "twin; use Map, RandomMap, Filter and a final Batch.")
        per_shard = batch.batch_size if batch is not None else 1
        self.batched = batch is not None
        stream: Node = GrainSampler(sampler._num_records, s_count, s_drop, sampler._shuffle,  # noqa: SLF001
                                    sampler._seed, sampler._num_epochs)  # noqa: SLF001
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
        self.plan = stream.lanes(lanes).batch(rows)  # type: ignore[attr-defined]
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

    def __iter__(self) -> Iterator:
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
            sampler_opts = opts if s._shard_options.shard_count != 1 else s._shard_options  # noqa: SLF001
            args["sampler"] = grain.samplers.IndexSampler(
                s._num_records, shard_options=sampler_opts, shuffle=s._shuffle,  # noqa: SLF001
                num_epochs=s._num_epochs, seed=s._seed)  # noqa: SLF001
            args["shard_options"] = opts
        return grain.DataLoader(**args)


# --- verify matrix -------------------------------------------------------------------------------

def grain_fingerprints(batches: Iterable[Any], steps: int, lanes: int = 1) -> list[str]:
    """Step fingerprints of the first `steps` batches of a real Grain pipeline.

    Each Grain batch is taken as a global batch split into `lanes` equal lane blocks and digested
    exactly like `zephon.verify.global_fingerprint` (bytes/str columns compared as exact
    values), so the list equals `Dataset.fingerprints(steps)` of the Zephon twin built with the
    same lane count when the data is the same. For a sharded `grain.DataLoader`, pass the
    shards' batches concatenated (`concat_shards`).
    """
    out = []
    it = iter(batches)
    for _ in range(steps):
        out.append(global_fingerprint(grain_batch_columns(next(it)), lanes))
    return out


def concat_shards(loaders: Sequence[Iterable[Any]]) -> TypingIterator[Any]:
    """Global batches from the per-shard batches of several Grain loaders (shard order)."""
    its = [iter(l) for l in loaders]
    while True:
        try:
            parts = [grain_batch_columns(next(i)) for i in its]
        except StopIteration:
            return
        yield unflatten_columns({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


__all__ = [
    "BestFitPackIterDataset", "Branches", "Collate", "CollatingLoader", "ConcatThenSplitIterDataset",
    "ContiguousBatches", "DataLoader", "Dataset", "FirstFitPackIterDataset", "GrainPackNames",
    "LaneOp", "PackInput", "experimental", "merge_states",
    "GrainFilter", "GrainIndex", "GrainLoaderOrder", "GrainMap", "GrainMapWithIndex",
    "GrainMix", "GrainRandomMap", "GrainSampler", "GrainShuffle", "GrainSource", "IndexedRefs",
    "Iterator", "READ_AHEAD", "RECORD", "RNG", "RecordsOf", "VALUE", "collate", "concat_shards",
    "even_split", "flatten_record", "grain_batch_columns", "grain_fingerprints",
    "grain_map_rng", "grain_proportions", "index_shuffle", "mix_selection", "records_of",
    "records_to_columns", "stack_leaves", "unflatten_columns", "with_collate",
]

"""The sample index algebra: which record sits at every row of every global batch.

A plan is a tree of small frozen nodes. The stream nodes (`Source`, `Shuffle`, `Repeat`, `Mix`,
`Slice`) map an array of stream positions to record references `(source, record, epoch)` with
vectorised integer math, in O(len(positions)) time and O(1) memory in the data set size. `Lanes`
deals the stream into canonical lanes, the unit of state and of data-parallel ownership, and the
root `Batch` lays `size / lanes` outputs of every lane side by side, lane-major. Because every
rank of every data-parallel degree `D` (with `lanes % D == 0`) reads its rows from the same lanes,
the global batch is a function of the plan and the step only.

Plans are JSON: `to_json`/`from_json` round-trip and `fingerprint()` hashes the canonical form,
so a checkpoint can prove which plan wrote it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Literal, Mapping as Mapping_, Sequence

import numpy as np

from zephon.errors import PlanError
from zephon.jsondoc import json_object
from zephon.permute import permute

Mapping = Literal["contiguous", "interleaved"]
_FOREVER_EPOCH_STRIDE = 1 << 32  # epochs of an outer pass around a forever-repeat never collide


@dataclass(frozen=True)
class Refs:
    """Record references, one per position: which source, which record, which epoch.

    `extra` holds optional further int64 columns, one value per position, that a node adds while
    resolving (e.g. Grain's element index at some depth of a pipeline, `grain_index/<tag>`).
    They ride along through every node, filter (`take`) and merge (`concat`, mixes); a row that
    comes from a part without a column gets `EXTRA_FILL`.
    """

    source: np.ndarray
    record: np.ndarray
    epoch: np.ndarray
    extra: Mapping_[str, np.ndarray] = dataclasses.field(default_factory=dict)

    EXTRA_FILL: ClassVar[int] = -1

    def __len__(self) -> int:
        return len(self.record)

    def take(self, idx: np.ndarray | slice) -> "Refs":
        return Refs(self.source[idx], self.record[idx], self.epoch[idx],
                    {k: v[idx] for k, v in self.extra.items()})

    def with_extra(self, name: str, values: np.ndarray) -> "Refs":
        """These references with column `name` added (or replaced)."""
        return Refs(self.source, self.record, self.epoch, {**self.extra, name: values})

    @staticmethod
    def concat(parts: Sequence["Refs"]) -> "Refs":
        names = sorted({k for p in parts for k in p.extra})
        extra = {k: np.concatenate([p.extra[k] if k in p.extra else
                                    np.full(len(p), Refs.EXTRA_FILL, np.int64) for p in parts])
                 for k in names}
        return Refs(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("source", "record", "epoch")),
                    extra)


def _positions(pos: np.ndarray | Sequence[int] | int) -> np.ndarray:
    p = np.atleast_1d(np.asarray(pos, dtype=np.int64))
    if p.size and p.min() < 0:
        raise PlanError(f"positions must be non-negative, got {int(p.min())}")
    return p


class Node:
    """A stream of record references with random access by position."""

    _registry: ClassVar[dict[str, type["Node"]]] = {}
    #: The node's name in plan JSON (`"type"`): part of the file format, so renaming or moving a
    #: class never breaks a saved plan. Set it with `class MyNode(Node, kind="my.Node")`.
    kind: ClassVar[str] = ""

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = kind or cls.__name__
        other = Node._registry.get(name)
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
            raise PlanError(f"plan node kind {name!r} of {cls.__module__}.{cls.__qualname__} is "
                            f"already taken by {other.__module__}.{other.__qualname__}; declare a "
                            f"unique one: class {cls.__name__}(..., kind='package.{cls.__name__}').")
        cls.kind = name
        Node._registry[name] = cls

    # --- the algebra -------------------------------------------------------------------------
    @property
    def length(self) -> int | None:
        """Number of positions, or None for an infinite stream."""
        raise NotImplementedError(f"{type(self).__name__} must define length (and _resolve)")

    @property
    def period(self) -> int | None:
        """Epoch length of an infinite stream that repeats (what a shuffle may permute within)."""
        return None

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        raise NotImplementedError(f"{type(self).__name__} must define _resolve(pos, epoch) -> Refs")

    def resolve(self, positions: np.ndarray | Sequence[int] | int) -> Refs:
        """The record references at `positions` (vectorised)."""
        pos = _positions(positions)
        n = self.length
        if n is not None and pos.size and pos.max() >= n:
            raise PlanError(f"position {int(pos.max())} is past the end of a stream of {n}")
        return self._resolve(pos, np.zeros_like(pos))

    # --- fluent builder ----------------------------------------------------------------------
    def shuffle(self, seed: int) -> "Shuffle":
        return Shuffle(self, seed)

    def repeat(self, count: int | None = None) -> "Repeat":
        return Repeat(self, count)

    def slice(self, start: int = 0, stop: int | None = None, step: int = 1) -> "Slice":
        return Slice(self, start, stop, step)

    def take(self, n: int) -> "Slice":
        return Slice(self, 0, n)

    def skip(self, n: int) -> "Slice":
        return Slice(self, n, None)

    def lanes(self, count: int, mapping: Mapping = "contiguous") -> "Lanes":
        return Lanes(self, count, mapping)

    @staticmethod
    def mix(children: Sequence["Node"], weights: Sequence[float] | None = None,
            by: Literal["samples", "tokens"] = "samples", count_field: str = "tokens") -> "Mix":
        children = tuple(children)
        return Mix(children, weights if weights is not None else (1.0,) * len(children), by, count_field)

    # --- serialisation -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, Node):
                v = v.to_json()
            elif isinstance(v, tuple) and v and isinstance(v[0], Node):
                v = [c.to_json() for c in v]
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @staticmethod
    def from_json(obj: dict[str, Any] | str) -> "Node":
        obj = dict(json_object(
            obj,
            lambda e: PlanError(f"plan JSON is not valid ({e}); pass what Node.to_json() or "
                                "canonical_json() wrote."),
            lambda kind: PlanError(f"a plan node is a JSON object with a 'type', got {kind}")))
        kind = obj.pop("type", None)
        cls = Node._registry.get(kind or "")
        if cls is None:
            raise PlanError(f"unknown plan node type {kind!r}; known: {sorted(Node._registry)}. Plans "
                            "with Grain-order nodes need `import zephon.compat.grain` first.")
        args: dict[str, Any] = {}
        for k, v in obj.items():
            if k == "child":
                v = Node.from_json(v)
            elif k == "children":
                v = tuple(Node.from_json(c) for c in v)
            elif isinstance(v, list):
                v = tuple(v)
            args[k] = v
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(args)
        unknown = sorted(set(args) - fields)
        if unknown:
            raise PlanError(f"plan node {kind} has unknown field(s) {unknown}; known: {sorted(fields)}. "
                            "The plan was edited or written by another Zephon.")
        try:
            return cls(**args)
        except TypeError as e:
            raise PlanError(f"plan node {kind} cannot be built from {sorted(args)}: {e}") from None

    def canonical_json(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON (hex, first 16 bytes): the plan's identity."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:32]


class PassThrough(Node, kind="PassThrough"):
    """A node whose stream has its child's length and epoch length (it reorders or annotates)."""

    child: Node

    @property
    def length(self) -> int | None:
        return self.child.length

    @property
    def period(self) -> int | None:
        return self.child.period


def _check_int(name: str, v: Any, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise PlanError(f"{name} must be an integer >= {minimum}, got {v!r}")


@dataclass(frozen=True)
class Source(Node, kind="Source"):
    """Positions 0..size-1 of record source `id` (the loader maps ids to record sources)."""

    size: int
    id: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.size, (int, np.integer)) and not isinstance(self.size, bool) and self.size == 0:
            raise PlanError(f"Source {self.name or self.id} is empty (size 0); a plan needs at least "
                            "one record per source — check the file/split you pointed it at.")
        _check_int("Source.size", self.size, 1)
        _check_int("Source.id", self.id, 0)

    @property
    def length(self) -> int:
        return int(self.size)

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        return Refs(np.full(pos.shape, self.id, np.int64), pos, epoch)


@dataclass(frozen=True)
class Shuffle(PassThrough, kind="Shuffle"):
    """A keyed bijection per epoch.

    Over a repeated stream (a child with a `period`) it permutes within each epoch, so every
    record still appears once per epoch; otherwise it permutes the whole (finite) child.
    """

    child: Node
    seed: int

    def __post_init__(self) -> None:
        _check_int("Shuffle.seed", self.seed, 0)
        if self.child.length is None and self.child.period is None:
            raise PlanError("cannot shuffle an infinite stream that has no epoch length (e.g. a mix "
                            "of repeated sources); shuffle each child before repeat/mix, or mix "
                            "finite sources and then repeat and shuffle.")

    @property
    def _block(self) -> int:
        p = self.child.period
        return p if p is not None else self.child.length  # type: ignore[return-value]

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        n = self._block
        block, inner = np.divmod(pos, n)
        # Key by (outer epoch + block): Repeat(Shuffle(x)) and Shuffle(Repeat(x)) are the same stream.
        shuffled = permute(inner, n, self.seed, epoch + block)
        return self.child._resolve(block * n + shuffled, epoch)


@dataclass(frozen=True)
class Repeat(Node, kind="Repeat"):
    """`count` passes over a finite child (None: forever); each pass is a new epoch."""

    child: Node
    count: int | None = None

    def __post_init__(self) -> None:
        if self.count is not None:
            _check_int("Repeat.count", self.count, 1)
        if self.child.length is None:
            raise PlanError("cannot repeat an infinite stream; repeat before mixing or take() a "
                            "finite prefix first.")

    @property
    def length(self) -> int | None:
        return None if self.count is None else self.child.length * self.count  # type: ignore[operator]

    @property
    def period(self) -> int:
        return self.child.length  # type: ignore[return-value]

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        e, inner = np.divmod(pos, self.period)
        stride = self.count if self.count is not None else _FOREVER_EPOCH_STRIDE
        return self.child._resolve(inner, epoch * stride + e)


@dataclass(frozen=True)
class Mix(Node, kind="Mix"):
    """A deterministic weighted interleave with exact weights and O(1) random access.

    The children form a balanced binary tree; at a node whose left side has weight fraction `w`,
    the first `n` positions send `floor(n·w + 1/2)` to the left, so every prefix of the stream
    holds each side within half a record of its share, and a position's child and its index
    in that child follow from a few float operations per tree level (the same IEEE arithmetic
    on every platform). Weights are used as given (normalised), never rounded to a ratio of
    small integers, so 0.999/0.001 is 0.999/0.001.

    Directly under `lanes()`, a mix is applied *inside every lane* (each child is dealt into the
    lanes on its own), so every lane — and every rank at every data-parallel degree — sees the
    mixture. `by="tokens"` makes the lane engine balance realised token counts instead of record
    counts (the length of column `count_field` after each child's pipeline); such a mix has no
    random access by position (its schedule depends on the data) and must sit under `lanes()`.
    """

    children: tuple[Node, ...]
    weights: tuple[float, ...]
    by: Literal["samples", "tokens"] = "samples"
    count_field: str = "tokens"

    def __post_init__(self) -> None:
        if not isinstance(self.children, tuple):
            object.__setattr__(self, "children", tuple(self.children))
        weights = self.weights
        if isinstance(weights, (Mapping_, str, bytes)) or not isinstance(weights, Iterable):
            raise PlanError(f"Mix weights must be a list of numbers, one per child, got {weights!r}")
        if not isinstance(weights, tuple):
            object.__setattr__(self, "weights", tuple(weights))
        if not self.children:
            raise PlanError("Mix needs at least one child")
        if not all(isinstance(c, Node) for c in self.children):
            raise PlanError("Mix children must be plan nodes (e.g. Source(n, id=i).repeat())")
        if len(self.weights) != len(self.children):
            raise PlanError(f"Mix has {len(self.children)} children but {len(self.weights)} weights; "
                            "give one weight per child.")
        if not all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
                   for x in self.weights):
            raise PlanError(f"Mix weights must be numbers, got {list(self.weights)}")
        w = [float(x) for x in self.weights]
        if any(not math.isfinite(x) or x < 0 for x in w) or max(w) <= 0:
            raise PlanError(f"Mix weights must be finite, non-negative and sum to a positive number, "
                            f"got {list(self.weights)}; a weight of 0 drops a child, NaN or a "
                            "negative weight is a mistake.")
        object.__setattr__(self, "weights", tuple(w))
        if self.by not in ("samples", "tokens"):
            raise PlanError(f"Mix.by must be 'samples' or 'tokens', got {self.by!r}")

    @functools.cached_property
    def normalized(self) -> np.ndarray:
        w = np.asarray(self.weights, np.float64)
        return w / w.max() / (w / w.max()).sum()  # scaled first: huge weights cannot overflow

    @functools.cached_property
    def _tree(self) -> tuple:
        """Nested (left, right, left fraction) over the children with positive weight."""
        w = self.normalized

        def build(ids: list[int]) -> Any:
            if len(ids) == 1:
                return ids[0]
            half = len(ids) // 2
            left, right = ids[:half], ids[half:]
            total = float(w[ids].sum())
            return (build(left), build(right), float(w[left].sum()) / total)

        return build([i for i in range(len(w)) if w[i] > 0])

    def route(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(child, index within that child) of mix positions `pos` (vectorised)."""
        pos = np.asarray(pos, np.int64)
        child = np.empty_like(pos)
        inner = np.empty_like(pos)

        def walk(node: Any, idx: np.ndarray, n: np.ndarray) -> None:
            if not isinstance(node, tuple):
                child[idx], inner[idx] = node, n
                return
            left, right, w = node
            c0 = np.floor(n * w + 0.5).astype(np.int64)
            c1 = np.floor((n + 1) * w + 0.5).astype(np.int64)
            go_left = c1 > c0
            walk(left, idx[go_left], c0[go_left])
            walk(right, idx[~go_left], (n - c0)[~go_left])

        walk(self._tree, np.arange(len(pos)), pos)
        return child, inner

    def counts(self, n: int) -> np.ndarray:
        """How many of the first `n` positions go to each child (exact, O(children))."""
        out = np.zeros(len(self.children), np.int64)

        def walk(node: Any, m: int) -> None:
            if not isinstance(node, tuple):
                out[node] = m
                return
            left, right, w = node
            c = int(np.floor(np.float64(m) * w + 0.5))
            walk(left, c)
            walk(right, m - c)

        walk(self._tree, int(n))
        return out

    def length_for(self, sizes: Sequence[int | None]) -> int | None:
        """Positions until the first child of size `sizes[i]` (None: infinite) runs out."""
        ends = []
        for i, n in enumerate(sizes):
            if n is None or self.normalized[i] == 0:
                continue
            lo, hi = 0, max(2, int(2 * (n + 1) / self.normalized[i]) + 2)
            while lo < hi:  # first m with counts(m)[i] > n: the stream holds m - 1 positions
                mid = (lo + hi) // 2
                if self.counts(mid)[i] > n:
                    hi = mid
                else:
                    lo = mid + 1
            ends.append(lo - 1)
        return min(ends) if ends else None

    @property
    def length(self) -> int | None:
        if self.by == "tokens":
            return None
        return self.length_for([c.length for c in self.children])

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        if self.by == "tokens":
            raise PlanError("a Mix by tokens has no order by position (its schedule depends on "
                            "token counts); put it directly under .lanes(L) and read it with a Loader.")
        which, inner = self.route(pos)
        return _gather_children(self.children, which, inner, epoch)


def _gather_children(children: Sequence[Node], which: np.ndarray, inner: np.ndarray,
                     epoch: np.ndarray) -> Refs:
    """Row i is child `which[i]`'s reference at (`inner[i]`, `epoch[i]`); extra columns merge
    (rows of a child without one get `Refs.EXTRA_FILL`)."""
    src = np.empty_like(inner)
    rec = np.empty_like(inner)
    ep = np.empty_like(inner)
    extra: dict[str, np.ndarray] = {}
    for i, c in enumerate(children):
        m = np.flatnonzero(which == i)
        if m.size:
            r = c._resolve(inner[m], epoch[m])
            src[m], rec[m], ep[m] = r.source, r.record, r.epoch
            for k, v in r.extra.items():
                extra.setdefault(k, np.full(inner.shape, Refs.EXTRA_FILL, np.int64))[m] = v
    return Refs(src, rec, ep, extra)


@dataclass(frozen=True)
class Slice(Node, kind="Slice"):
    """Positions start, start+step, ... < stop of the child (Take and Skip are special cases)."""

    child: Node
    start: int = 0
    stop: int | None = None
    step: int = 1

    def __post_init__(self) -> None:
        _check_int("Slice.start", self.start, 0)
        _check_int("Slice.step", self.step, 1)
        if self.stop is not None:
            _check_int("Slice.stop", self.stop, self.start)
        if self.length == 0:
            raise PlanError(f"Slice({self.start}, {self.stop}) of a stream of {self.child.length} "
                            "positions is empty; widen the slice.")

    @property
    def length(self) -> int | None:
        stop = self.child.length if self.stop is None else (
            self.stop if self.child.length is None else min(self.stop, self.child.length))
        if stop is None:
            return None
        return max(0, -(-(stop - self.start) // self.step))

    @property
    def period(self) -> int | None:
        p = self.child.period
        if self.stop is None and self.step == 1 and p is not None and self.start % p == 0:
            return p
        return None

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        return self.child._resolve(self.start + pos * self.step, epoch)


def Take(child: Node, n: int) -> Slice:  # noqa: N802 - reads as a node in plan expressions
    return Slice(child, 0, n)


def Skip(child: Node, n: int) -> Slice:  # noqa: N802
    return Slice(child, n, None)


@dataclass(frozen=True)
class Lanes(Node, kind="Lanes"):
    """Deals the stream into `count` canonical lanes: lane l owns positions l, l+count, ...

    Lanes are the unit of state (cursors, accumulators) and of ownership. A data-parallel rank
    r of D owns lanes [r*L/D, (r+1)*L/D) ("contiguous") or {l : l % D == r} ("interleaved").
    """

    child: Node
    count: int
    mapping: Mapping = "contiguous"

    def __post_init__(self) -> None:
        _check_int("Lanes.count", self.count, 1)
        if self.mapping not in ("contiguous", "interleaved"):
            raise PlanError(f"Lanes.mapping must be 'contiguous' or 'interleaved', got {self.mapping!r}")
        n = self.child.length if not isinstance(self.child, Mix) else min(
            (c.length for c in self.child.children if c.length is not None), default=None)
        if n is not None and n < self.count:
            raise PlanError(f"{self.count} lanes over a stream of {n} positions leave lanes empty; "
                            "use fewer lanes or repeat the data.")

    @property
    def length(self) -> int | None:
        if self.mixed:
            n = self.lane_length()
            return None if n is None else n * self.count
        return self.child.length

    @property
    def mixed(self) -> bool:
        """Whether the child is a Mix, applied inside every lane."""
        return isinstance(self.child, Mix)

    @property
    def branches(self) -> tuple[Node, ...]:
        """Streams the lane engine reads separately: a token Mix's children, else the child."""
        if isinstance(self.child, Mix) and self.child.by == "tokens":
            return self.child.children
        return (self.child,)

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        if self.mixed:
            lane, index = np.divmod(pos, self.count)[::-1]
            return self.resolve_lanes(lane, index)
        return self.child._resolve(pos, epoch)

    def lane_length(self) -> int | None:
        """Inputs every lane has (the shortest lane's count); None if infinite."""
        if isinstance(self.child, Mix):
            if self.child.by == "tokens":
                return None
            return self.child.length_for([None if c.length is None else c.length // self.count
                                          for c in self.child.children])
        n = self.child.length
        return None if n is None else n // self.count

    def branch_length(self, branch: int) -> int | None:
        """Inputs every lane has of branch `branch` (see `branches`)."""
        if len(self.branches) == 1:
            return self.lane_length()
        n = self.branches[branch].length
        return None if n is None else n // self.count

    def stream_positions(self, lanes: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Stream position of input `index` of lane `lanes` (broadcast)."""
        return np.asarray(index, np.int64) * self.count + np.asarray(lanes, np.int64)

    def batch(self, size: int) -> "Batch":
        """The plan's root: global batches of `size` rows, `size / count` from every lane."""
        return Batch(self, size)

    def resolve_lanes(self, lanes: np.ndarray, index: np.ndarray, branch: int = 0) -> Refs:
        """Record references of input `index` of lane `lanes` (of `branch`; broadcast)."""
        lanes = np.asarray(lanes, np.int64)
        index = np.asarray(index, np.int64)
        lanes, index = np.broadcast_arrays(lanes, index)
        if len(self.branches) > 1:
            return self.branches[branch].resolve(self.stream_positions(lanes, index))
        if isinstance(self.child, Mix):
            which, inner = self.child.route(index)
            pos = self.stream_positions(lanes, inner)
            for i, c in enumerate(self.child.children):
                n = c.length
                m = which == i
                if n is not None and m.any() and pos[m].max() >= n:
                    raise PlanError(f"input {int(index[m].max())} of a lane is past the end of the mix")
            return _gather_children(self.child.children, which, pos, np.zeros_like(pos))
        return self.resolve(self.stream_positions(lanes, index))

    def owned(self, rank: int, world: int) -> np.ndarray:
        """The lanes data-parallel rank `rank` of `world` owns, in global lane order."""
        check_degree(self.count, world)
        if not 0 <= rank < world:
            raise PlanError(f"rank {rank} is outside [0, {world}) for a data-parallel degree of {world}")
        if self.mapping == "contiguous":
            per = self.count // world
            return np.arange(rank * per, (rank + 1) * per, dtype=np.int64)
        return np.arange(rank, self.count, world, dtype=np.int64)


def check_degree(lanes: int, world: int) -> None:
    from zephon.errors import check_positive_int, divisors

    world = check_positive_int(world, "the data-parallel degree")
    if lanes % world:
        raise PlanError(f"lanes={lanes} is not divisible by the data-parallel degree {world}; "
                        f"run with a degree in {divisors(lanes)}, or build the plan with a lane count that "
                        f"every degree you will use divides (e.g. lanes={math.lcm(lanes, world)}).")


@dataclass(frozen=True)
class Batch(Node, kind="Batch"):
    """The plan's root: global batch k holds size/lanes outputs of every lane, lane-major.

    Row j of batch k is output (k * per_lane + j % per_lane) of lane j // per_lane.
    """

    child: Lanes
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.child, Lanes):
            raise PlanError("Batch must wrap a Lanes node: build plans as "
                            "stream.lanes(L).batch(B) (B divisible by L).")
        _check_int("Batch.size", self.size, 1)
        if self.size % self.child.count:
            raise PlanError(f"batch size {self.size} is not divisible by lanes={self.child.count}; "
                            f"every lane contributes the same number of rows, so choose a batch "
                            f"size that is a multiple of {self.child.count}.")

    @property
    def lanes(self) -> Lanes:  # type: ignore[override]
        return self.child

    @property
    def per_lane(self) -> int:
        return self.size // self.child.count

    @property
    def length(self) -> int | None:
        """Number of full global batches (1:1 pipelines); None if infinite."""
        n = self.child.lane_length()
        return None if n is None else n // self.per_lane

    num_steps = length

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        return self.child._resolve(pos, epoch)

    def rows(self, step: int, lanes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(lane, lane output index) of every row of batch `step` that `lanes` own (default all).

        Rows come in global row order restricted to those lanes.
        """
        _check_step(step)
        lanes = np.arange(self.child.count, dtype=np.int64) if lanes is None else np.asarray(lanes, np.int64)
        b = self.per_lane
        lane = np.repeat(lanes, b)
        index = step * b + np.tile(np.arange(b, dtype=np.int64), len(lanes))
        return lane, index

    def refs(self, step: int, lanes: np.ndarray | None = None) -> Refs:
        """Record references of batch `step`'s rows (restricted to `lanes`) for 1:1 pipelines."""
        n = self.length
        if n is not None and step >= n:
            raise PlanError(f"step {step} is past the end of the plan ({n} global batches)")
        if len(self.child.branches) > 1:
            raise PlanError("a Mix by tokens has no order by position: which record fills a row "
                            "depends on the token counts before it. Iterate a Loader and use "
                            "LocalBatch.explain() (or `zephon explain MODULE:FACTORY --step K`).")
        lane, index = self.rows(step, lanes)
        return self.child.resolve_lanes(lane, index)

    def explain(self, step: int) -> list[dict[str, int]]:
        """For every row of global batch `step`: row, lane, source, record, epoch."""
        lane, _ = self.rows(step)
        r = self.refs(step)
        return [{"row": j, "lane": int(lane[j]), "source": int(r.source[j]),
                 "record": int(r.record[j]), "epoch": int(r.epoch[j])} for j in range(len(lane))]

    def explain_text(self, step: int) -> str:
        rows = self.explain(step)
        head = f"{'row':>5} {'lane':>5} {'source':>6} {'record':>14} {'epoch':>6}"
        return "\n".join([head] + [f"{r['row']:>5} {r['lane']:>5} {r['source']:>6} {r['record']:>14} "
                                    f"{r['epoch']:>6}" for r in rows])


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise PlanError(f"step must be an integer, got {step!r}")
    if step < 0:
        raise PlanError(f"step must be non-negative, got {step}; steps count global batches from 0.")



Plan = Batch
"""A complete plan is its root `Batch` node."""


def plan_diff(a: dict[str, Any] | Any, b: dict[str, Any] | Any, path: str = "plan") -> list[str]:
    """Human-readable differences between two plans' JSON, for refusing a foreign checkpoint."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {a.get(k, '<absent>')!r} != {b.get(k, '<absent>')!r}")
            else:
                out += plan_diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in plan_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]

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
from fractions import Fraction
from typing import Any, ClassVar, Literal, Sequence

import numpy as np

from zephon.errors import PlanError
from zephon.permute import permute

Mapping = Literal["contiguous", "interleaved"]
_FOREVER_EPOCH_STRIDE = 1 << 32  # epochs of an outer pass around a forever-repeat never collide


@dataclass(frozen=True)
class Refs:
    """Record references, one per position: which source, which record, which epoch."""

    source: np.ndarray
    record: np.ndarray
    epoch: np.ndarray

    def __len__(self) -> int:
        return len(self.record)

    def take(self, idx: np.ndarray | slice) -> "Refs":
        return Refs(self.source[idx], self.record[idx], self.epoch[idx])

    @staticmethod
    def concat(parts: Sequence["Refs"]) -> "Refs":
        return Refs(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("source", "record", "epoch")))


def _positions(pos: np.ndarray | Sequence[int] | int) -> np.ndarray:
    p = np.atleast_1d(np.asarray(pos, dtype=np.int64))
    if p.size and p.min() < 0:
        raise PlanError(f"positions must be non-negative, got {int(p.min())}")
    return p


class Node:
    """A stream of record references with random access by position."""

    _registry: ClassVar[dict[str, type["Node"]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Node._registry[cls.__name__] = cls

    # --- the algebra -------------------------------------------------------------------------
    @property
    def length(self) -> int | None:
        """Number of positions, or None for an infinite stream."""
        raise NotImplementedError

    @property
    def period(self) -> int | None:
        """Epoch length of an infinite stream that repeats (what a shuffle may permute within)."""
        return None

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        raise NotImplementedError

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
    def mix(children: Sequence["Node"], weights: Sequence[float] | None = None) -> "Mix":
        children = tuple(children)
        return Mix(children, tuple(weights) if weights is not None else (1.0,) * len(children))

    # --- serialisation -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": type(self).__name__}
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
        if isinstance(obj, str):
            obj = json.loads(obj)
        obj = dict(obj)
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
        return cls(**args)

    def canonical_json(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> str:
        """SHA-256 of the canonical JSON (hex, first 16 bytes): the plan's identity."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:32]


class PassThrough(Node):
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
class Source(Node):
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
class Shuffle(PassThrough):
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
class Repeat(Node):
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
class Mix(Node):
    """A deterministic weighted interleave.

    Weights become small integers w_i (rational approximation); a period of sum(w_i) slots holds
    child i exactly w_i times, spread evenly. The count of child i among the first t positions is
    then (t // period) * w_i + prefix, so random access stays O(1).
    """

    children: tuple[Node, ...]
    weights: tuple[float, ...]

    MAX_PERIOD: ClassVar[int] = 1 << 16

    def __post_init__(self) -> None:
        if not self.children:
            raise PlanError("Mix needs at least one child")
        if len(self.weights) != len(self.children):
            raise PlanError(f"Mix has {len(self.children)} children but {len(self.weights)} weights; "
                            "give one weight per child.")
        w = [float(x) for x in self.weights]
        if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise PlanError(f"Mix weights must be finite, non-negative and sum to a positive number, "
                            f"got {list(self.weights)}")
        if self.period_slots > self.MAX_PERIOD:
            raise PlanError(f"Mix weights {list(self.weights)} need a schedule of {self.period_slots} "
                            f"slots (> {self.MAX_PERIOD}); round them to simpler ratios.")

    @functools.cached_property
    def int_weights(self) -> tuple[int, ...]:
        fr = [Fraction(float(x)).limit_denominator(1000) for x in self.weights]
        den = math.lcm(*(f.denominator for f in fr))
        ints = [int(f * den) for f in fr]
        g = math.gcd(*ints)
        return tuple(i // g for i in ints)

    @property
    def period_slots(self) -> int:
        return sum(self.int_weights)

    @functools.cached_property
    def _schedule(self) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """(child per slot, occurrence rank per slot, slots of each child)."""
        w = self.int_weights
        child = np.concatenate([np.full(wi, i, np.int64) for i, wi in enumerate(w)])
        rank = np.concatenate([np.arange(wi, dtype=np.int64) for wi in w])
        ideal = (2 * rank + 1) / (2 * np.asarray(w, np.float64)[child])  # evenly spread
        order = np.lexsort((child, ideal))
        child, rank = child[order], rank[order]
        slots = [np.flatnonzero(child == i) for i in range(len(w))]
        return child, rank, slots

    @property
    def length(self) -> int | None:
        w = self.int_weights
        P = self.period_slots
        _, _, slots = self._schedule
        ends = []
        for i, c in enumerate(self.children):
            n = c.length
            if n is not None and w[i] > 0:
                q, r = divmod(n, w[i])  # position of child i's n-th (0-based) occurrence
                ends.append(q * P + int(slots[i][r]))
        return min(ends) if ends else None

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        child_of, rank_of, _ = self._schedule
        q, s = np.divmod(pos, self.period_slots)
        which = child_of[s]
        inner = q * np.asarray(self.int_weights, np.int64)[which] + rank_of[s]
        src = np.empty_like(pos)
        rec = np.empty_like(pos)
        ep = np.empty_like(pos)
        for i, c in enumerate(self.children):
            m = np.flatnonzero(which == i)
            if m.size:
                r = c._resolve(inner[m], epoch[m])
                src[m], rec[m], ep[m] = r.source, r.record, r.epoch
        return Refs(src, rec, ep)


@dataclass(frozen=True)
class Slice(Node):
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
class Lanes(Node):
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
        n = self.child.length
        if n is not None and n < self.count:
            raise PlanError(f"{self.count} lanes over a stream of {n} positions leave lanes empty; "
                            "use fewer lanes or repeat the data.")

    @property
    def length(self) -> int | None:
        return self.child.length

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        return self.child._resolve(pos, epoch)

    def lane_length(self) -> int | None:
        """Inputs every lane has (the shortest lane's count); None if infinite."""
        n = self.child.length
        return None if n is None else n // self.count

    def stream_positions(self, lanes: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Stream position of input `index` of lane `lanes` (broadcast)."""
        return np.asarray(index, np.int64) * self.count + np.asarray(lanes, np.int64)

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
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)) or world < 1:
        raise PlanError(f"the data-parallel degree must be a positive integer, got {world!r}")
    if lanes % world:
        good = [d for d in range(1, lanes + 1) if lanes % d == 0]
        raise PlanError(f"lanes={lanes} is not divisible by the data-parallel degree {world}; "
                        f"run with a degree in {good}, or build the plan with a lane count that "
                        f"every degree you will use divides (e.g. lanes={math.lcm(lanes, world)}).")


@dataclass(frozen=True)
class Batch(Node):
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
        lane, index = self.rows(step, lanes)
        return self.child.resolve(self.child.stream_positions(lane, index))

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


def _lanes_batch(self: Lanes, size: int) -> Batch:
    return Batch(self, size)


Lanes.batch = _lanes_batch  # type: ignore[attr-defined]

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

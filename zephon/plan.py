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

This module holds the node contract (registry, JSON, fingerprint) and the plain stream nodes;
`Mix` and its routing live in `zephon.mixing`, `Lanes`/`Batch` in `zephon.batching`, each a
concept of its own, and are re-exported here, so `zephon.plan` names the whole algebra.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping as Mapping_
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from zephon.errors import PlanError
from zephon.jsondoc import json_object
from zephon.permute import permute

__all__ = ["MAX_POSITION", "Batch", "BlockShuffle", "Lanes", "Mapping", "Mix", "Node", "PassThrough", "Plan",
           "Refs", "Repeat", "Shuffle", "Skip", "Slice", "Source", "Take", "check_degree", "plan_diff"]

Mapping = Literal["contiguous", "interleaved"]
_FOREVER_EPOCH_STRIDE = 1 << 32  # epochs of an outer pass around a forever-repeat never collide
#: Every stream position, lane input, step × batch size and checkpoint cursor stays below this.
#: Positions are int64 (`index × lanes + lane`, `step × size`): past 2**63 they would wrap round
#: to the first steps' data without a word, so they are refused where they enter instead.
MAX_POSITION = 1 << 62


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

    def take(self, idx: np.ndarray | slice) -> Refs:
        return Refs(self.source[idx], self.record[idx], self.epoch[idx],
                    {k: v[idx] for k, v in self.extra.items()})

    def with_extra(self, name: str, values: np.ndarray) -> Refs:
        """These references with column `name` added (or replaced)."""
        return Refs(self.source, self.record, self.epoch, {**self.extra, name: values})

    @staticmethod
    def concat(parts: Sequence[Refs]) -> Refs:
        names = sorted({k for p in parts for k in p.extra})
        extra = {k: np.concatenate([p.extra[k] if k in p.extra else
                                    np.full(len(p), Refs.EXTRA_FILL, np.int64) for p in parts])
                 for k in names}
        source, record, epoch = (np.concatenate([getattr(p, f) for p in parts])
                                 for f in ("source", "record", "epoch"))
        return Refs(source, record, epoch, extra)


def _positions(pos: np.ndarray | Sequence[int] | int) -> np.ndarray:
    try:
        p = np.atleast_1d(np.asarray(pos, dtype=np.int64))
    except OverflowError:
        raise PlanError(f"positions must be below 2**62 (MAX_POSITION), got {pos!r}") from None
    if p.size and p.min() < 0:
        raise PlanError(f"positions must be non-negative, got {int(p.min())}")
    if p.size and p.max() >= MAX_POSITION:
        raise PlanError(f"position {int(p.max())} is beyond 2**62 (MAX_POSITION), the most a plan "
                        "addresses (int64 arithmetic on it would wrap round to step 0's data).")
    return p


class Node:
    """A stream of record references with random access by position."""

    _registry: ClassVar[dict[str, type[Node]]] = {}
    #: The node's name in plan JSON (`"type"`): part of the file format, so renaming or moving a
    #: class never breaks a saved plan. Set it with `class MyNode(Node, kind="my.Node")`.
    kind: ClassVar[str] = ""
    #: Values of fields that `to_json` leaves out (keeping older plans' fingerprints) and whose
    #: absence means something else than the constructor's default.
    json_absent: ClassVar[dict[str, Any]] = {}

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

    def resolve(self, positions: np.ndarray | Sequence[int] | int, epoch: int = 0) -> Refs:
        """The record references at `positions` (vectorised) in pass `epoch` over the stream:
        epoch e of a finite stream is what `repeat()` makes its e-th pass (shuffles re-keyed)."""
        pos = _positions(positions)
        n = self.length
        if n is not None and pos.size and pos.max() >= n:
            raise PlanError(f"position {int(pos.max())} is past the end of a stream of {n}")
        return self._resolve(pos, np.full_like(pos, epoch))

    # --- fluent builder ----------------------------------------------------------------------
    def shuffle(self, seed: int) -> Shuffle:
        return Shuffle(self, seed)

    def block_shuffle(self, seed: int, block: int | Literal["auto"] = "auto",
                      window: int | Literal["auto"] = "auto",
                      stripes: int | Literal["auto"] = "auto") -> BlockShuffle:
        """Permute blocks of `block` consecutive records, then the records within windows of
        `window` blocks (`zephon.blockshuffle`): the shuffle for data in object storage."""
        from zephon.blockshuffle import BlockShuffle  # imported here: it builds on this module

        return BlockShuffle(self, seed, block, window, stripes)

    def repeat(self, count: int | None = None) -> Repeat:
        return Repeat(self, count)

    def slice(self, start: int = 0, stop: int | None = None, step: int = 1) -> Slice:
        return Slice(self, start, stop, step)

    def take(self, n: int) -> Slice:
        return Slice(self, 0, n)

    def skip(self, n: int) -> Slice:
        return Slice(self, n, None)

    def lanes(self, count: int, mapping: Mapping = "contiguous") -> Lanes:
        from zephon.batching import Lanes  # imported here: batching builds on this module

        return Lanes(self, count, mapping)

    @staticmethod
    def mix(children: Sequence[Node], weights: Sequence[float] | None = None,
            by: Literal["samples", "tokens", "trained_tokens"] = "samples", count_field: str = "tokens",
            schedule: Sequence[tuple[int, Sequence[float]]] = (), mask_field: str = "loss_mask",
            stop: Literal["first", "all"] = "first") -> Mix:
        from zephon.mixing import Mix  # imported here: mixing builds on this module

        children = tuple(children)
        return Mix(children, weights if weights is not None else (1.0,) * len(children), by, count_field,
                   schedule, mask_field, stop)

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
    def from_json(obj: dict[str, Any] | str) -> Node:
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
        for k, v in cls.json_absent.items():
            args.setdefault(k, v)
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


def Take(child: Node, n: int) -> Slice:
    return Slice(child, 0, n)


def Skip(child: Node, n: int) -> Slice:
    return Slice(child, n, None)


# The routing of a mix and the lanes/batch root live in their own modules; this one stays the
# algebra's front door, so `from zephon.plan import Mix, Lanes, Batch` keeps working.
from zephon.batching import Batch, Lanes, check_degree  # noqa: E402
from zephon.blockshuffle import BlockShuffle  # noqa: E402
from zephon.mixing import Mix  # noqa: E402

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

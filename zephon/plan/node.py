"""The plan node contract: the kind registry, JSON, the fingerprint, and the shared checks.

A plan is a tree of small frozen nodes (`zephon.plan`). Every node class registers under an
explicit `kind` — its name in plan JSON — so `Node.from_json` can rebuild any plan and the fluent
builders (`.shuffle()`, `.lanes()`, ...) can find the classes built on this module without
importing them. `PassThrough` is the base of nodes that keep their child's length.

Terms (docs/glossary.md): plan, node, fingerprint, position, epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from zephon.errors import PlanError
from zephon.plan.jsondoc import json_object
from zephon.plan.refs import Refs

if TYPE_CHECKING:
    from zephon.plan.blockshuffle import BlockShuffle
    from zephon.plan.lanes import Lanes
    from zephon.plan.mix import Mix
    from zephon.plan.repeat import Repeat
    from zephon.plan.shuffle import Shuffle
    from zephon.plan.slice import Slice

__all__ = ["MAX_POSITION", "Mapping", "Node", "PassThrough", "check_int", "check_positions", "node_class"]

#: How a rank's lanes are chosen: a contiguous range, or every D-th lane.
Mapping = Literal["contiguous", "interleaved"]
#: Every stream position, lane input, step × batch size and checkpoint cursor stays below this.
#: Positions are int64 (`index × lanes + lane`, `step × size`): past 2**63 they would wrap round
#: to the first steps' data without a word, so they are refused where they enter instead.
MAX_POSITION = 1 << 62


def check_positions(pos: np.ndarray | Sequence[int] | int) -> np.ndarray:
    """`pos` as a 1-d int64 array of valid stream positions, or a PlanError saying which is not."""
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
        pos = check_positions(positions)
        n = self.length
        if n is not None and pos.size and pos.max() >= n:
            raise PlanError(f"position {int(pos.max())} is past the end of a stream of {n}")
        return self._resolve(pos, np.full_like(pos, epoch))

    # --- fluent builder ----------------------------------------------------------------------
    # Each builder finds its class through the kind registry (every node class registers itself;
    # `zephon.plan` imports them all), so this module imports none of the modules built on it.
    def shuffle(self, seed: int) -> Shuffle:
        return node_class("Shuffle")(self, seed)

    def block_shuffle(self, seed: int, block: int | Literal["auto"] = "auto",
                      window: int | Literal["auto"] = "auto",
                      stripes: int | Literal["auto"] = "auto") -> BlockShuffle:
        """Permute blocks of `block` consecutive records, then the records within windows of
        `window` blocks (`zephon.plan.blockshuffle`): the shuffle for data in object storage."""
        return node_class("BlockShuffle")(self, seed, block, window, stripes)

    def repeat(self, count: int | None = None) -> Repeat:
        return node_class("Repeat")(self, count)

    def slice(self, start: int = 0, stop: int | None = None, step: int = 1) -> Slice:
        return node_class("Slice")(self, start, stop, step)

    def take(self, n: int) -> Slice:
        """The first `n` positions of this stream."""
        return node_class("Slice")(self, 0, n)

    def skip(self, n: int) -> Slice:
        """This stream without its first `n` positions."""
        return node_class("Slice")(self, n, None)

    def lanes(self, count: int, mapping: Mapping = "contiguous") -> Lanes:
        return node_class("Lanes")(self, count, mapping)

    @staticmethod
    def mix(children: Sequence[Node], weights: Sequence[float] | None = None,
            by: Literal["samples", "tokens", "trained_tokens"] = "samples", count_field: str = "tokens",
            schedule: Sequence[tuple[int, Sequence[float]]] = (), mask_field: str = "loss_mask",
            stop: Literal["first", "all"] = "first") -> Mix:
        children = tuple(children)
        return node_class("Mix")(children, weights if weights is not None else (1.0,) * len(children), by,
                                 count_field, schedule, mask_field, stop)

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


def check_int(name: str, v: Any, minimum: int) -> None:
    """A PlanError unless `v` is an integer (not a bool) of at least `minimum`; `name` names it."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise PlanError(f"{name} must be an integer >= {minimum}, got {v!r}")


def node_class(kind: str) -> Any:
    """The node class registered under `kind` (its name in plan JSON)."""
    cls = Node._registry.get(kind)
    if cls is None:
        raise PlanError(f"no plan node kind {kind!r} is registered; import zephon.plan first")
    return cls

"""`Mix`: a deterministic weighted interleave of plan streams, and its routing tree.

A position of a mix goes to one child by walking a balanced binary tree of the children's weight
fractions, a few float operations a level; counts of any prefix are exact. Its own module because
the routing (tree, `route`, `counts`, `length_for`) is the one piece of the algebra that is not a
line or two of integer math; `zephon.plan` exports `Mix`. (Per-source *pipelines* of a mix are
a lane operator: `zephon.ops.mix.PerSource`.)

Terms (docs/glossary.md): branch, lane, epoch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from collections.abc import Mapping as Mapping_
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from zephon.errors import PlanError
from zephon.plan.node import Node
from zephon.plan.refs import Refs


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
    `by="trained_tokens"` balances only the tokens the loss sees: those whose per-token mask
    (column `mask_field`, e.g. what `zephon.ops.chat.Chat` writes) is non-zero, after a
    document's first token (the tokens that are some position's target once packed) — so a
    1:1 mix of chat sets with short and long answers is 1:1 in trained tokens, with the same
    guarantee as by tokens: every lane within one document of its weights.

    `schedule` (by tokens only) is a curriculum that is part of the plan: `((step, weights),
    ...)` with increasing steps; `weights` apply from step 0, each entry's from its step on.
    At each such step every lane starts its token counts afresh under the new weights, so the
    mixture follows the schedule in every lane, at every D and across a resume.

    `stop` says where a finite mix ends: "first" (the default) when its first child runs out;
    "all" reads every child whole — once a child is exhausted in a lane, that lane draws from the
    remaining children with their weights renormalised, until every child is exhausted. Like a
    mix by tokens, a mix with `stop="all"` is followed inside every lane by the lane engine (by
    samples it counts one per record), so it sits directly under `lanes()`.
    """

    children: tuple[Node, ...]
    weights: tuple[float, ...]
    by: Literal["samples", "tokens", "trained_tokens"] = "samples"
    count_field: str = "tokens"
    schedule: tuple[tuple[int, tuple[float, ...]], ...] = ()
    mask_field: str = "loss_mask"
    stop: Literal["first", "all"] = "first"

    if TYPE_CHECKING:  # the generated __init__ takes any sequences (__post_init__ makes them tuples)
        def __init__(self, children: Sequence[Node], weights: Sequence[float],
                     by: Literal["samples", "tokens", "trained_tokens"] = "samples",
                     count_field: str = "tokens", schedule: Sequence[tuple[int, Sequence[float]]] = (),
                     mask_field: str = "loss_mask", stop: Literal["first", "all"] = "first") -> None: ...

    def __post_init__(self) -> None:
        if not isinstance(self.children, tuple):
            object.__setattr__(self, "children", tuple(self.children))
        if not self.children:
            raise PlanError("Mix needs at least one child")
        if not all(isinstance(c, Node) for c in self.children):
            raise PlanError("Mix children must be plan nodes (e.g. Source(n, id=i).repeat())")
        object.__setattr__(self, "weights", _checked_weights(self.weights, len(self.children), "Mix weights"))
        schedule = self.schedule
        if isinstance(schedule, (Mapping_, str, bytes)) or not isinstance(schedule, Iterable):
            raise PlanError(f"Mix schedule must be a list of (step, weights) pairs, got {schedule!r}")
        entries: list[tuple[int, tuple[float, ...]]] = []
        for entry in schedule:
            pair: tuple[Any, ...] = tuple(entry) if isinstance(entry, Iterable) else ()
            if isinstance(entry, (str, bytes)) or len(pair) != 2:
                raise PlanError(f"each entry of a Mix schedule is a (step, weights) pair, got {entry!r}")
            step, w = pair
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
                raise PlanError(f"a Mix schedule step must be an integer >= 1 (the weights apply "
                                f"from step 0 until the first), got {step!r}")
            if entries and step <= entries[-1][0]:
                raise PlanError(f"Mix schedule steps must increase, got {step} after {entries[-1][0]}")
            entries.append((int(step), _checked_weights(w, len(self.children), f"Mix weights from step {step}")))
        object.__setattr__(self, "schedule", tuple(entries))
        if self.stop not in ("first", "all"):
            raise PlanError(f"Mix.stop must be 'first' (end with the first exhausted child) or 'all' "
                            f"(read every child whole), got {self.stop!r}")
        if self.by not in ("samples", "tokens", "trained_tokens"):
            raise PlanError(f"Mix.by must be 'samples', 'tokens' or 'trained_tokens', got {self.by!r}")
        if not isinstance(self.mask_field, str) or not self.mask_field:
            raise PlanError(f"Mix.mask_field must be a column name, got {self.mask_field!r}")
        if self.schedule and not self.by_tokens:
            raise PlanError("a Mix weight schedule needs Mix(..., by='tokens'): a mix by samples "
                            "routes each position with one set of weights (its random access), "
                            "while a mix by tokens is followed step by step in every lane, where "
                            "the weights can change at a step.")

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.stop == "first":  # plans without these keep the fingerprints they always had
            del out["stop"]
        if not self.schedule:
            del out["schedule"]
        else:
            out["schedule"] = [[step, list(w)] for step, w in self.schedule]
        if self.by != "trained_tokens":  # (as mask_field: only a mix by trained tokens reads it)
            del out["mask_field"]
        return out

    @property
    def by_tokens(self) -> bool:
        """Whether the lane engine schedules this mix by counts of tokens (all or trained)."""
        return self.by in ("tokens", "trained_tokens")

    def weights_from(self) -> list[tuple[int, np.ndarray]]:
        """(first step, normalised weights) of every stretch of the schedule, from step 0."""
        return [(0, self.normalized)] + [(step, _normalized(w)) for step, w in self.schedule]

    @functools.cached_property
    def normalized(self) -> np.ndarray:
        return _normalized(self.weights)

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
    def sequential(self) -> bool:
        """Whether the lane engine follows this mix (by tokens, or read whole): no random access."""
        return self.by_tokens or self.stop == "all"

    @property
    def length(self) -> int | None:
        if self.by_tokens:
            return None
        if self.stop == "all":
            sizes = [c.length for c, w in zip(self.children, self.normalized) if w > 0]
            return None if any(n is None for n in sizes) else sum(int(n or 0) for n in sizes)
        return self.length_for([c.length for c in self.children])

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        if self.stop == "all":
            raise PlanError("a Mix with stop='all' is followed inside every lane (which child comes "
                            "next depends on which ran out); put it directly under .lanes(L) and "
                            "read it with a Loader.")
        if self.by_tokens:
            raise PlanError("a Mix by tokens has no order by position (its schedule depends on "
                            "token counts); put it directly under .lanes(L) and read it with a Loader.")
        which, inner = self.route(pos)
        return gather_children(self.children, which, inner, epoch)


def _checked_weights(weights: Any, n: int, what: str) -> tuple[float, ...]:
    """`weights` as n floats, or a PlanError saying what is wrong with them."""
    if isinstance(weights, (Mapping_, str, bytes)) or not isinstance(weights, Iterable):
        raise PlanError(f"{what} must be a list of numbers, one per child, got {weights!r}")
    weights = tuple(weights)
    if len(weights) != n:
        which = "" if what == "Mix weights" else f" ({what})"
        raise PlanError(f"Mix has {n} children but {len(weights)} weights{which}; give one weight "
                        "per child.")
    if not all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
               for x in weights):
        raise PlanError(f"{what} must be numbers, got {list(weights)}")
    w = tuple(float(x) for x in weights)
    if any(not math.isfinite(x) or x < 0 for x in w) or max(w) <= 0:
        raise PlanError(f"{what} must be finite, non-negative and sum to a positive number, "
                        f"got {list(weights)}; a weight of 0 drops a child, NaN or a "
                        "negative weight is a mistake.")
    return w


def _normalized(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    return w / w.max() / (w / w.max()).sum()  # scaled first: huge weights cannot overflow


def gather_children(children: Sequence[Node], which: np.ndarray, inner: np.ndarray,
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

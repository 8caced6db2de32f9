"""`Lanes`: deals a stream into canonical lanes, the unit of state and of data-parallel ownership.

Rank r of D owns a fixed set of lanes (`check_degree` says which D a plan allows); the root
(`zephon.plan.batching.Batching`, built by `.batch(B)`) lays `B / lanes` outputs of every lane
side by side, so the global batch is the same for every D. A `Mix` directly under `lanes()` is
applied inside every lane.

Terms (docs/glossary.md): lane, lanes owned, branch, step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from zephon.errors import PlanError, check_positive_int, divisors
from zephon.plan.batchsizes import parse_schedule, steps_from_tokens
from zephon.plan.mix import Mix, gather_children
from zephon.plan.node import MAX_POSITION, Mapping, Node, check_int, node_class
from zephon.plan.refs import Refs

if TYPE_CHECKING:
    from zephon.plan.batching import Batching

__all__ = ["Lanes", "Remainder", "check_degree"]

#: How a finite plan ends (see `Batching`): "auto" (the Loader decides), "drop" or "pad".
Remainder = Literal["auto", "drop", "pad"]


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
        check_int("Lanes.count", self.count, 1)
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
        if isinstance(self.child, Mix) and self.child.sequential:
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
            if self.child.sequential:
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

    def lane_limits(self, lanes: np.ndarray, branch: int = 0, pad: bool = False) -> np.ndarray | None:
        """Inputs of `branch` (see `branches`) each of `lanes` has; None if infinite.

        Dropping (`pad=False`) every lane has the shortest lane's count, as `branch_length`;
        padding, every position of a finite stream is dealt: lane l holds positions l, l+L, ...
        below the end, so the first `n % L` lanes hold one input more.
        """
        lanes = np.asarray(lanes, np.int64)
        if not pad:
            n = self.branch_length(branch)
            return None if n is None else np.full(lanes.shape, n, np.int64)
        table = self._pad_limits(branch)
        return None if table is None else table[lanes]

    @functools.lru_cache(maxsize=8)  # noqa: B019 (frozen, hashable node; a handful of branches)
    def _pad_limits(self, branch: int) -> np.ndarray | None:
        every = np.arange(self.count, dtype=np.int64)
        if len(self.branches) > 1 or not isinstance(self.child, Mix):
            n = self.branches[branch].length
            return None if n is None else (n - every + self.count - 1) // self.count
        sizes = [[None if c.length is None else (c.length - l + self.count - 1) // self.count
                  for c in self.child.children] for l in range(self.count)]
        got = [self.child.length_for(s) for s in sizes]
        return None if any(g is None for g in got) else np.array(got, np.int64)

    @property
    def max_index(self) -> int:
        """Lane inputs are below this: input `i` of a lane is stream position `i × count + lane`,
        which must stay below `MAX_POSITION` (a cursor in a state beyond it is refused)."""
        return MAX_POSITION // self.count

    def stream_positions(self, lanes: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Stream position of input `index` of lane `lanes` (broadcast)."""
        return np.asarray(index, np.int64) * self.count + np.asarray(lanes, np.int64)

    def batch(self, size: int | None = None, *, schedule: Sequence[tuple[int, int]] | None = None,
              by: Literal["steps", "tokens"] = "steps", seq_len: int | None = None,
              remainder: Remainder = "auto") -> Batching:
        """The plan's root: global batches of `size` rows, `size / count` from every lane;
        `remainder` ("auto", "drop" or "pad") decides the end of a finite plan (see `Batching`).

        Or a batch-size `schedule` (a ramp-up), part of the plan: `((0, 256), (2000, 512), ...)`
        — from step 0 256 rows, from step 2000 512, ... With `by="tokens"` the first numbers are
        tokens seen (rows of `seq_len` tokens, e.g. packed), converted to steps by
        `zephon.plan.batchsizes.steps_from_tokens`. Every size must be a multiple of `count`.
        """
        batching = node_class("Batch")  # the Batching class, by its kind (it builds on this module)
        if schedule is None:
            if by != "steps" or seq_len is not None:
                raise PlanError("by= and seq_len= describe a schedule: pass schedule=((0, B0), (t1, B1), ...)")
            if size is None:
                raise PlanError("batch() needs a size, e.g. .batch(256), or schedule=((0, 256), (2000, 512))")
            return batching(self, size, remainder=remainder)
        if by == "tokens":
            if seq_len is None:
                raise PlanError("a batch schedule by tokens needs seq_len= (the tokens of one row)")
            entries = steps_from_tokens(schedule, seq_len)
        elif by == "steps":
            if seq_len is not None:
                raise PlanError("seq_len= only applies to a schedule by='tokens'")
            entries = parse_schedule(schedule)
        else:
            raise PlanError(f"a batch schedule is by 'steps' or 'tokens', got by={by!r}")
        if not entries or entries[0][0] != 0:
            raise PlanError(f"a batch schedule starts at step 0 (the size of the first batches), got "
                            f"{entries[:1]}; e.g. schedule=((0, 256), (2000, 512)).")
        if size is not None and size != entries[0][1]:
            raise PlanError(f"batch({size}, schedule=...) disagrees with the schedule's first size "
                            f"{entries[0][1]}; give the schedule only.")
        return batching(self, entries[0][1], tuple(entries[1:]), remainder)

    def resolve_lanes(self, lanes: np.ndarray, index: np.ndarray, branch: int = 0, epoch: int = 0) -> Refs:
        """Record references of input `index` of lane `lanes` (of `branch`; broadcast), in pass
        `epoch` over a finite plan (the order `repeat()` gives its e-th pass)."""
        lanes = np.asarray(lanes, np.int64)
        index = np.asarray(index, np.int64)
        lanes, index = np.broadcast_arrays(lanes, index)
        if len(self.branches) > 1:
            return self.branches[branch].resolve(self.stream_positions(lanes, index), epoch)
        if isinstance(self.child, Mix):
            which, inner = self.child.route(index)
            pos = self.stream_positions(lanes, inner)
            for i, c in enumerate(self.child.children):
                n = c.length
                m = which == i
                if n is not None and m.any() and pos[m].max() >= n:
                    raise PlanError(f"input {int(index[m].max())} of a lane is past the end of the mix")
            return gather_children(self.child.children, which, pos, np.full_like(pos, epoch))
        return self.resolve(self.stream_positions(lanes, index), epoch)

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
    """A PlanError unless the data-parallel degree `world` divides the lane count `lanes`."""
    world = check_positive_int(world, "the data-parallel degree")
    if lanes % world:
        raise PlanError(f"lanes={lanes} is not divisible by the data-parallel degree {world}; "
                        f"run with a degree in {divisors(lanes)}, or build the plan with a lane count that "
                        f"every degree you will use divides (e.g. lanes={math.lcm(lanes, world)}).")

"""A lane's position: what a checkpoint stores per lane, and nothing more.

Per branch (a token mix reads each source's lane stream separately) the next input and how many
of its outputs were already used; the mix's token counters; the inputs an accumulator still holds,
named by position (`[branch, input, output]`), and its JSON carry. Never data, never pickles.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import StateError
from zephon.plan import MAX_POSITION


@dataclass(frozen=True)
class LaneState:
    """Where a lane stands: per branch its next input (`cursor`) and how many outputs of that
    input it already used (`skip`), the mix counters, the inputs an accumulator holds (as
    `[branch, input, output]` positions) and the accumulator's JSON carry."""

    cursor: tuple[int, ...]
    skip: tuple[int, ...] = ()
    mix: tuple[int, ...] = ()
    held: tuple[tuple[int, int, int], ...] = ()
    carry: Any = None

    @staticmethod
    def start(branches: int = 1, cursor: int = 0, mixed: bool = False) -> LaneState:
        return LaneState((cursor,) * branches, (0,) * branches, (0,) * branches if mixed else ())

    def to_json(self, carry: bool = False) -> dict[str, Any]:
        """JSON (a copy); `carry=True` writes `held`/`carry` even when empty, as pipelines with
        an accumulator do, so every lane of their state has the same keys."""
        out: dict[str, Any] = {"cursor": list(self.cursor), "skip": list(self.skip)}
        if self.mix:
            out["mix"] = list(self.mix)
        if carry or self.held or self.carry is not None:
            out["held"] = [list(h) for h in self.held]
            out["carry"] = copy.deepcopy(self.carry)
        return out

    @staticmethod
    def from_json(obj: Any, lane: int | str = "?", branches: int = 1, mixed: bool = False,
                  limits: Sequence[int | None] = (), bound: int = MAX_POSITION) -> LaneState:
        """Parses and checks one lane's JSON; `limits` are the inputs each branch's lane has,
        `bound` the input index no lane reaches (`Lanes.max_index`: beyond it a stream position
        `index × lanes + lane` would wrap round in int64)."""
        where = f"lane {lane} of the state"
        if not isinstance(obj, Mapping):
            raise StateError(f"{where} is {type(obj).__name__}, expected an object with 'cursor'")

        def ints(key: str, n: int, default: int | None = None, top: int = bound) -> tuple[int, ...]:
            v = obj.get(key)
            if v is None and default is not None:
                return (default,) * n
            if isinstance(v, int) and not isinstance(v, bool) and n == 1:
                v = [v]
            if (not isinstance(v, list) or len(v) != n
                    or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < top for x in v)):
                raise StateError(f"{where} has an invalid {key!r}: {v!r}; expected {n} non-negative "
                                 f"integer(s) below {top}. The state was edited or belongs to another "
                                 "pipeline.")
            return tuple(v)

        cursor = ints("cursor", branches)
        for b, limit in enumerate(limits):
            if limit is not None and cursor[b] > limit:
                raise StateError(f"{where} is at input {cursor[b]}"
                                 f"{f' of source branch {b}' if branches > 1 else ''}, beyond its "
                                 f"{limit} inputs ('cursor'); the state was edited or belongs to "
                                 "another plan.")
        skip = ints("skip", branches, 0)
        mix = ints("mix", branches, top=MAX_POSITION) if mixed else ()
        for b, m in enumerate(mix):  # a token counter counts inputs the branch already consumed
            if m and cursor[b] == 0 and skip[b] == 0:
                raise StateError(f"{where} counts {m} tokens of source branch {b} ('mix') but has "
                                 "not read an input of it ('cursor' 0); the state was edited.")
        held_raw = obj.get("held", [])
        if (not isinstance(held_raw, list) or any(
                not isinstance(h, list) or len(h) != 3 or any(isinstance(x, bool) or not isinstance(x, int)
                                                              or not 0 <= x < bound for x in h)
                or h[0] >= branches for h in held_raw)):
            raise StateError(f"{where} has an invalid 'held' list {held_raw!r}; expected "
                             "[branch, input, output] triples.")
        for b, i, o in held_raw:  # held inputs were consumed: they lie before the lane's position
            if (i, o) >= (cursor[b], skip[b]):
                raise StateError(f"{where} has an invalid 'held' entry {[b, i, o]}: it lies at or after "
                                 f"the lane's position (input {cursor[b]}, output {skip[b]}) of branch "
                                 f"{b}; the state was edited.")
        return LaneState(cursor, skip, mix, tuple(tuple(h) for h in held_raw), obj.get("carry"))


def canonical(cursor: np.ndarray, skip: np.ndarray, expands: bool) -> tuple[np.ndarray, np.ndarray]:
    """Writes positions one way (per lane or branch): after a fully used input, `(input + 1, 0)`.
    Unless an operator expands inputs (a flat map), an input's outputs are used whole, so a
    position saved after it must equal one saved before the next: states compare and merge."""
    if expands:
        return cursor, skip
    return cursor + (skip > 0), np.zeros_like(skip)

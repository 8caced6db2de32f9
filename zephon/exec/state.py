"""A lane's position: what a checkpoint stores per lane, and nothing more.

Per branch (a token mix reads each source's lane stream separately) the next input and how many
of its outputs were already used; the mix's token counters; the inputs an accumulator still holds,
named by position (`[branch, input, output]`), and its JSON carry. Never data, never pickles.

Terms (docs/glossary.md): cursor, held, carry, state.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.checkpoint import STATE_VERSION, check_state_version, state_checksum
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


def check_state(state: Any) -> None:
    """Refuses what is not a Zephon state of a version this Zephon reads, naming the problem."""
    if not isinstance(state, Mapping) or "zephon_state" not in state:
        raise StateError("not a Zephon loader state (no 'zephon_state' key); pass the dict that "
                         "Loader.state() (or state_dict()/get_state()) returned.")
    check_state_version(state)
    if state["zephon_state"] == 2:
        raise StateError(f"this state has format 2 (before checksums); this Zephon reads format "
                         f"{STATE_VERSION}. Upgrade its file with `zephon state resign FILE` (after "
                         "checking it is the checkpoint you mean), then load it again.")
    if state["zephon_state"] != STATE_VERSION:
        raise StateError(f"this state has format {state['zephon_state']!r}; this Zephon reads format "
                         f"{STATE_VERSION}. It was written by an older Zephon: restart from step 0 "
                         "or resume with the version that wrote it.")
    if "checksum" in state and state["checksum"] != state_checksum(state):
        raise StateError("this state fails its 'checksum': it changed after save_state wrote it (a "
                         "flipped bit or an edit) and could resume another stream. Load the file with "
                         "load_state(); if you edited it on purpose, `zephon state resign FILE`.")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StateError(f"checkpoint step {step!r} is not a non-negative integer")


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Unions the lane states of every rank's `state()` taken at the same step."""
    if not states:
        raise StateError("merge_states needs at least one state")
    for s in states:
        check_state(s)
        if not isinstance(s.get("lanes"), Mapping):
            raise StateError(f"a state's 'lanes' is {type(s.get('lanes')).__name__}, expected an "
                             "object {lane: state}; pass states as Loader.state() returns them.")
    head = dict(states[0])
    for s in states[1:]:
        for key in ("plan_fingerprint", "seed", "pipeline", "step", "lane_shift", "epoch"):
            if s.get(key) != head.get(key):
                raise StateError(f"cannot merge states with different {key}: "
                                 f"{s.get(key)!r} != {head.get(key)!r}")
    lanes: dict[str, Any] = {}
    for i, s in enumerate(states):
        for k, v in s["lanes"].items():
            if k in lanes and lanes[k] != v:  # the result would depend on the argument order
                raise StateError(f"cannot merge: lane {k} appears in two states with different "
                                 f"positions ({lanes[k]!r} and, in state {i}, {v!r}); they were not "
                                 "taken at the same step of one run. Merge the states every rank "
                                 "saved at one step.")
            lanes[k] = v
    head.pop("checksum", None)  # a file's checksum: the merged document is a new one
    head["lanes"] = lanes
    return head

"""Continuing from a saved state or a position: what is checked before any lane moves.

A restore is where a checkpoint from another plan, pipeline, seed, rank or batch size would
silently resume another stream, so every field is checked against this loader before any lane
moves, and each refusal names what differs and what to do. `Resume` checks and parses; the
`Engine` that holds it applies what it returns (`Position`), so each reads on its own.
Terms: docs/glossary.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import StateError
from zephon.exec.pipeline import LanePipeline
from zephon.exec.resize import batch_change, lane_shift_of
from zephon.exec.schedule import check_counters
from zephon.exec.state import LaneState, check_state
from zephon.ops.base import identity_diff
from zephon.plan import Batching, Mix, plan_diff


@dataclass(frozen=True)
class Position:
    """A parsed, checked position: where the loader goes."""

    step: int
    epoch: int
    #: lane positions relative to the plan's (a run resumed at another batch size)
    shift: int
    #: the owned lanes' states at `step`
    lanes: list[LaneState]
    #: every lane's states (a merged state restored by a loader owning fewer lanes): the end of
    #: a finite count-changing plan is counted from them
    everyone: list[LaneState] | None = None


@dataclass(frozen=True, eq=False)
class Resume:
    """Checks states and positions against one loader's run: its plan, its lanes (`owned` of
    rank `rank` of `world`), its source branches and lane pipeline, and which core it runs."""

    plan: Batching
    owned: np.ndarray
    rank: int
    world: int
    branches: int
    stages: LanePipeline
    random_access: bool

    @property
    def token_mix(self) -> bool:
        return self.branches > 1

    def check(self, state: Mapping[str, Any], mine: Mapping[str, Any], *, allow_batch_change: bool = False
              ) -> int | None:
        """Refuses `state` unless it was saved by this loader's plan, seed and pipeline (`mine`:
        the loader's `identity()`), naming what differs. A state saved under another global batch
        size (or schedule) of the same plan is refused too, naming both, unless
        `allow_batch_change=True`: then the lane shift that keeps every lane where it stopped is
        returned (the batches from the saved step on are this plan's sizes); else None."""
        check_state(state)
        old = None
        if state.get("plan_fingerprint") != mine["plan_fingerprint"]:
            old = batch_change(state.get("plan"), self.plan, allow_batch_change)
        if state.get("plan_fingerprint") != mine["plan_fingerprint"] and old is None:
            diffs = plan_diff(state.get("plan"), self.plan.to_json())
            raise StateError("this checkpoint was written by another plan (fingerprint "
                             f"{state.get('plan_fingerprint')} != {mine['plan_fingerprint']}); "
                             f"differences: {'; '.join(diffs[:5]) or 'unknown'}. Restore it with the "
                             "plan that wrote it, or start this plan from step 0.")
        if state.get("seed") != mine["seed"]:
            raise StateError(f"this checkpoint's seed {state.get('seed')!r} differs from the "
                             f"loader's {mine['seed']!r}; use the same seed to resume.")
        saved = state.get("pipeline")
        diffs = identity_diff(saved if isinstance(saved, list) else [], mine["pipeline"])
        if diffs:
            raise StateError("this checkpoint was written by a different pipeline: "
                             f"{'; '.join(diffs[:5])}. Resume with the operators that wrote it (same "
                             "name, version and config), or start from step 0.")
        if old is None:
            return None
        # the lanes stay where they are; this plan's steps start there
        step = state["step"]
        return int(old.lane_offset(step) + lane_shift_of(state) - self.plan.lane_offset(step))

    def parse(self, position: Mapping[str, Any], *, lane_shift: int | None = None) -> Position:
        """Parses and checks a `position()` (or state) of a loader of the same plan and pipeline
        whose lanes include this one's (no identity check: see `check`). `lane_shift` overrides
        the position's (a resume at another batch size)."""
        step = position.get("step") if isinstance(position, Mapping) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateError(f"the state's step {step!r} is not a non-negative integer")
        epoch = position.get("epoch", 0)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise StateError(f"the state's epoch {epoch!r} is not a non-negative integer")
        if step > self.plan.max_step:
            raise StateError(f"the state's step {step} is beyond the last step this plan addresses "
                             f"({self.plan.max_step}, from 2**62 positions); the state was edited or "
                             "is corrupt — restore an earlier checkpoint.")
        lanes = position.get("lanes")
        if not isinstance(lanes, Mapping):
            raise StateError(f"the state's 'lanes' is {type(lanes).__name__}, expected an object "
                             "{lane: state}")
        count = self.plan.lanes.count
        alien = [k for k in lanes if not (isinstance(k, str) and k.isascii() and k.isdigit() and int(k) < count)]
        if alien:
            raise StateError(f"the state's 'lanes' names lane(s) {alien[:8]} that this plan does not "
                             f"have: it has {count} lanes, 0..{count - 1}; the state was edited or "
                             "belongs to another plan.")
        missing = [int(l) for l in self.owned if str(int(l)) not in lanes]
        if missing:
            has = sorted(int(k) for k in lanes)
            held = f"lanes {has[0]}..{has[-1]}" if has == list(range(has[0], has[-1] + 1)) else f"lanes {has[:8]}"
            raise StateError(f"the state lacks lanes {missing[:8]}{'...' if len(missing) > 8 else ''} "
                             f"that this loader (rank {self.rank} of {self.world}) owns; it holds "
                             f"{held if has else 'no lanes'} — another rank's (or worker's) state. "
                             "Restore each rank's own state, or merge every rank's state with "
                             "merge_states() and restore that at any data-parallel degree.")
        shift = lane_shift_of(position) if lane_shift is None else int(lane_shift)
        table = [self.plan.lanes.lane_limits(np.arange(count), b, self.plan.pad) for b in range(self.branches)]
        if self.random_access and (n := self.plan.steps_over(shift)) is not None:
            table = [np.full(count, self.plan.lane_offset(n) + shift)]  # the step's position, padding too

        def parse(l: int) -> LaneState:
            limits = [None if t is None else int(t[l]) for t in table]
            return LaneState.from_json(lanes[str(l)], l, self.branches, self.token_mix, limits,
                                       self.plan.lanes.max_index)

        parsed = [parse(int(l)) for l in self.owned]
        mix = self.plan.lanes.child
        if self.token_mix and isinstance(mix, Mix):
            check_counters(mix, self.stages, step, zip((int(l) for l in self.owned), parsed))
        if self.plan.lane_offset(step) + shift < 0:
            raise StateError(f"the state's lane_shift {shift} puts step {step} before the lanes' "
                             "first input; the state was edited.")
        if self.random_access:
            at = self.plan.lane_offset(step) + shift
            for l, st in zip(self.owned, parsed):
                if st.cursor[0] != at or st.skip[0]:
                    raise StateError(f"lane {int(l)} of the state is at input {st.cursor[0]}, but step "
                                     f"{step} of this one-to-one pipeline puts every lane at "
                                     f"{at}; the state was edited.")
            return Position(step, epoch, shift, parsed)
        everyone = None
        if len(lanes) == count and len(self.owned) < count:  # a merged state: where every lane is
            everyone = [parse(l) for l in range(count)]
        return Position(step, epoch, shift, parsed, everyone)


__all__ = ["Position", "Resume"]

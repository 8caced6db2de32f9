"""The global batch size of every step: one size, or a schedule (a ramp-up) that is part of the plan.

Batch-size warm-up is standard in LLM pretraining (GPT-3's ramp, Megatron's
`--rampup-batch-size`), so the size is a function of the step, not a constant: `B(k)` rows at
step k, `B(k)/L` outputs of every lane. A lane is a sequential stream whatever B is, so the
only thing a schedule changes is how many of a lane's outputs each step takes. The lane position
of step k is then a prefix sum of the schedule, `offset(k) = Σ_{j<k} B(j)/L`, computed here in
closed form per stretch of constant size — vectorised over steps, never a loop over them — so
one-to-one pipelines keep O(1) random access.

A schedule by tokens (`(tokens_seen, B)`, packed rows of `seq_len` tokens) is converted to steps
by `steps_from_tokens` with integer arithmetic: each size starts at the first step whose tokens
seen before it reach the threshold.

Terms (docs/glossary.md): global batch, step.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import PlanError


def _int(v: Any, what: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise PlanError(f"{what} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def parse_schedule(schedule: Any, what: str = "batch schedule") -> list[tuple[int, int]]:
    """`schedule` as a list of (int, int) pairs, or a PlanError saying what a pair is."""
    if isinstance(schedule, (Mapping, str, bytes)) or not isinstance(schedule, Iterable):
        raise PlanError(f"a {what} is a list of (step, size) pairs, e.g. ((0, 256), (2000, 512)); "
                        f"got {schedule!r}")
    out = []
    for entry in schedule:
        pair = tuple(entry) if isinstance(entry, Iterable) and not isinstance(entry, (str, bytes)) else ()
        if len(pair) != 2:
            raise PlanError(f"each entry of a {what} is a (step, size) pair, got {entry!r}")
        out.append((_int(pair[0], f"a {what} step", 0), _int(pair[1], f"a {what} size", 1)))
    return out


def steps_from_tokens(schedule: Sequence[tuple[int, int]], seq_len: int) -> list[tuple[int, int]]:
    """A `(tokens_seen, B)` schedule as a `(step, B)` one, for rows of `seq_len` tokens.

    Size `B_i` starts at the first step k whose tokens seen before it (`Σ_{j<k} B(j)·seq_len`)
    are at least `tokens_i`; thresholds reached at the same step keep the last size. Integer
    arithmetic only, so every process and platform converts alike.
    """
    seq_len = _int(seq_len, "seq_len of a schedule by tokens", 1)
    entries = parse_schedule(schedule, "batch schedule by tokens")
    if not entries or entries[0][0] != 0:
        raise PlanError(f"a batch schedule by tokens starts at 0 tokens, got {entries[:1]}; "
                        "e.g. ((0, 256), (1_000_000_000, 512)).")
    _check_increasing([t for t, _ in entries], "batch schedule by tokens", "token counts")
    out = [(0, entries[0][1])]
    seen = 0  # tokens seen before step out[-1][0]
    for tokens, size in entries[1:]:
        start, cur = out[-1]
        per_step = cur * seq_len
        k = start + max(0, -(-(tokens - seen) // per_step))  # first step with `tokens` seen
        seen += (k - start) * per_step
        if k == start:  # reached at this stretch's first step already: the later size wins
            out[-1] = (start, size)
        else:
            out.append((k, size))
    return [e for i, e in enumerate(out) if i == 0 or e[1] != out[i - 1][1]]


def _check_increasing(keys: Sequence[int], what: str, unit: str) -> None:
    for a, b in itertools.pairwise(keys):
        if b <= a:
            raise PlanError(f"{what} {unit} must increase, got {b} after {a}")


@dataclass(frozen=True)
class BatchSizes:
    """Step -> global batch size for `lanes` lanes: `first` from step 0, then `changes`.

    `changes` are `(step, size)` with increasing steps >= 1; every size a multiple of `lanes`.
    """

    lanes: int
    first: int
    changes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _check_increasing([s for s, _ in self.changes], "batch schedule", "steps")
        for step, size in ((0, self.first),) + tuple(self.changes):
            if size % self.lanes:
                raise PlanError(f"batch size {size}{f' (from step {step})' if step else ''} is not "
                                f"divisible by lanes={self.lanes}; every lane contributes the same "
                                f"number of rows, so choose batch sizes that are multiples of {self.lanes}.")

    @functools.cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per stretch of constant size: first step, outputs a lane gives a step, and the lane
        position at the stretch's first step (the prefix sum up to it)."""
        starts = np.array([0] + [s for s, _ in self.changes], np.int64)
        per = np.array([self.first] + [b for _, b in self.changes], np.int64) // self.lanes
        base = np.concatenate([[0], np.cumsum(np.diff(starts) * per[:-1])]).astype(np.int64)
        return starts, per, base

    @property
    def constant(self) -> bool:
        return not self.changes

    def stretches(self) -> list[tuple[int, int]]:
        """`(first step, global size)` of every stretch, from step 0."""
        return [(0, self.first)] + list(self.changes)

    def stretch_end(self, step: int) -> int | None:
        """The first step after `step` with another size (None: the size stays from `step` on)."""
        later = [k for k, _ in self.changes if k > step]
        return later[0] if later else None

    @property
    def largest(self) -> int:
        """The largest global batch size of the schedule."""
        return max(b for _, b in self.stretches())

    def _where(self, steps: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._table[0], steps, side="right") - 1

    def per_lane(self, steps: np.ndarray | int) -> np.ndarray:
        """Outputs every lane gives step(s) `steps` (vectorised)."""
        return self._table[1][self._where(np.asarray(steps, np.int64))]

    def offset(self, steps: np.ndarray | int) -> np.ndarray:
        """Lane position (outputs of every lane taken before) at step(s) `steps` (vectorised)."""
        steps = np.asarray(steps, np.int64)
        starts, per, base = self._table
        i = self._where(steps)
        return base[i] + (steps - starts[i]) * per[i]

    def steps_within(self, n: int) -> int:
        """How many whole steps `n` outputs of every lane make (the plan's length)."""
        starts, per, base = self._table
        i = int(np.searchsorted(base, n, side="right")) - 1
        # a stretch never fills past the next one's base, so this stays inside stretch i
        return int(starts[i]) + (n - int(base[i])) // int(per[i])

    def rows(self, steps: np.ndarray, lanes: np.ndarray, shift: int = 0
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lane, lane output index, rows per step) of every row of `steps` that `lanes` own.

        Rows are step-major, then lane-major within a step (global row order restricted to
        `lanes`). `shift` moves every lane position (a resume at another batch size).
        """
        steps = np.asarray(steps, np.int64)
        lanes = np.asarray(lanes, np.int64)
        per = self.per_lane(steps)
        off = self.offset(steps) + shift
        if steps.size and int(off.min()) < 0:
            raise PlanError(f"step {int(steps[np.argmin(off)])} lies before the lanes' positions "
                            "this run resumed at (it resumed at another batch size); it has no rows "
                            "in this run.")
        cnt = np.repeat(per, len(lanes))  # rows of each (step, lane) pair
        lane = np.repeat(np.tile(lanes, len(steps)), cnt)
        first = np.repeat(np.repeat(off, len(lanes)), cnt)
        within = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        return lane, first + within, per * len(lanes)


__all__ = ["BatchSizes", "parse_schedule", "steps_from_tokens"]

"""The token-mix schedule: which source a lane reads next when a `Mix` counts tokens.

A `Mix(by="tokens")` cannot be resolved by the algebra (how many tokens a record holds is known
only after the pipeline ran), so each lane follows it during assembly: the next input comes from
the branch furthest behind its weight, counted in tokens, ties to the lower branch. Its own
module because it is a rule of the data (the lane's `mix` counters in a checkpoint are its state)
rather than of how the engine fetches windows.

A weight schedule (`Mix(schedule=...)`, a curriculum) changes the weights at given steps; at each
such step the lane's counters start from zero, so the lane follows the new weights from there as
closely as from step 0. The counters in a checkpoint are therefore those since the last change.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from zephon.errors import PlanError
from zephon.exec.windows import Window
from zephon.plan import Mix
from zephon.sources.base import Columns

#: `(branch, count) -> the lane's next `count` unused rows of that branch (fewer if it ended)`
Peek = Callable[[int, int], list[tuple[Window, int]]]


@dataclass(frozen=True)
class TokenSchedule:
    """A lane's deficit schedule over the branches of a token mix."""

    starts: tuple[int, ...]  # the step each set of weights applies from: 0, then the schedule's
    inv_weights: tuple[np.ndarray, ...]  # 1 / normalised weight (inf for 0: never chosen), per set
    count_field: str | None  # None: a mix by samples (each record counts one)
    mask_field: str | None = None  # a mix by trained tokens: count the mask's non-zero tokens
    read_all: bool = False  # Mix(stop="all"): an exhausted branch drops out, the others go on

    @staticmethod
    def of(mix: Mix) -> TokenSchedule:
        stretches = mix.weights_from()
        inv = tuple(np.where(w > 0, 1.0 / np.where(w > 0, w, 1.0), np.inf) for _, w in stretches)
        return TokenSchedule(tuple(s for s, _ in stretches), inv,
                             mix.count_field if mix.by_tokens else None,
                             mix.mask_field if mix.by == "trained_tokens" else None, mix.stop == "all")

    def restarts(self, step: int) -> bool:
        """Whether the weights change at `step` (the lanes' counters start from zero there)."""
        return step in self.starts[1:]

    def count(self, cols: Columns, r: int) -> int:
        """What the mix counts for row r: the length of its `count_field` column, or (by trained
        tokens) the non-zero entries of its mask after the first token: what the loss will see."""
        if self.mask_field is not None:
            m = cols.get(self.mask_field)
            if m is None:
                raise PlanError(f"a Mix by trained tokens counts the non-zero tokens of column "
                                f"{self.mask_field!r}, which the pipeline's rows do not have (fields: "
                                f"{sorted(cols)}); put a Chat (or a per-token mask) before the mix "
                                "or set Mix(mask_field=...).")
            return int(np.count_nonzero(np.asarray(m[r])[1:]))
        if self.count_field is None:  # a mix by samples read whole: every record counts one
            return 1
        v = cols.get(self.count_field)
        if v is None:
            raise PlanError(f"a Mix by tokens counts the length of column {self.count_field!r}, "
                            f"which the pipeline's rows do not have (fields: {sorted(cols)}); "
                            "tokenize before the mix or set Mix(count_field=...).")
        return len(v[r])

    def candidates(self, peek: Peek, count: int, mix: Sequence[int], step: int
                   ) -> tuple[list[tuple[Window, int]], list[int]]:
        """The lane's next `count` inputs for `step` and their branches, from the lane's counters
        `mix`; fewer when a branch's lane ran out (a finite mix ends there) — or, reading every
        child whole, when every branch with a weight ran out (until then the exhausted ones
        drop out and the rest keep their relative weights)."""
        inv_weights = self.inv_weights[bisect.bisect_right(self.starts, step) - 1].copy()
        counts = np.array(mix, np.float64)
        nb = len(counts)
        depth = [0] * nb
        peeked: list[list[tuple[Window, int]]] = [[] for _ in range(nb)]
        rows: list[tuple[Window, int]] = []
        branches: list[int] = []
        while len(rows) < count:
            score = np.where(np.isinf(inv_weights), np.inf, counts * inv_weights)
            b = int(np.argmin(score))
            if not np.isfinite(score[b]):
                break  # every branch with a weight ran out
            if depth[b] == len(peeked[b]):
                peeked[b] = peek(b, depth[b] + max(4, count))
                if depth[b] == len(peeked[b]):
                    if not self.read_all:
                        break
                    inv_weights[b] = np.inf
                    continue
            win, r = peeked[b][depth[b]]
            depth[b] += 1
            rows.append((win, r))
            branches.append(b)
            counts[b] += self.count(win.cols, r)
        return rows, branches

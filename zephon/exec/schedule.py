"""The token-mix schedule: which source a lane reads next when a `Mix` counts tokens.

A `Mix(by="tokens")` cannot be resolved by the algebra (how many tokens a record holds is known
only after the pipeline ran), so each lane follows it during assembly: the next input comes from
the branch furthest behind its weight, counted in tokens, ties to the lower branch. Its own
module because it is a rule of the data (the lane's `mix` counters in a checkpoint are its state)
rather than of how the engine fetches windows.
"""

from __future__ import annotations

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

    inv_weights: np.ndarray  # 1 / normalised weight (inf for a weight of 0: never chosen)
    count_field: str

    @staticmethod
    def of(mix: Mix) -> TokenSchedule:
        w = mix.normalized
        return TokenSchedule(np.where(w > 0, 1.0 / np.where(w > 0, w, 1.0), np.inf), mix.count_field)

    def count(self, cols: Columns, r: int) -> int:
        """What the mix counts for row r: the length of its `count_field` column."""
        v = cols.get(self.count_field)
        if v is None:
            raise PlanError(f"a Mix by tokens counts the length of column {self.count_field!r}, "
                            f"which the pipeline's rows do not have (fields: {sorted(cols)}); "
                            "tokenize before the mix or set Mix(count_field=...).")
        return len(v[r])

    def candidates(self, peek: Peek, count: int, mix: Sequence[int]
                   ) -> tuple[list[tuple[Window, int]], list[int]]:
        """The lane's next `count` inputs and their branches, from the lane's counters `mix`; fewer
        when a branch's lane ran out (a finite mix ends there)."""
        counts = np.array(mix, np.float64)
        nb = len(counts)
        depth = [0] * nb
        peeked: list[list[tuple[Window, int]]] = [[] for _ in range(nb)]
        rows: list[tuple[Window, int]] = []
        branches: list[int] = []
        while len(rows) < count:
            b = int(np.argmin(counts * self.inv_weights))
            if depth[b] == len(peeked[b]):
                peeked[b] = peek(b, depth[b] + max(4, count))
                if depth[b] == len(peeked[b]):
                    break
            win, r = peeked[b][depth[b]]
            depth[b] += 1
            rows.append((win, r))
            branches.append(b)
            counts[b] += self.count(win.cols, r)
        return rows, branches

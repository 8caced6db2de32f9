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
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from zephon.errors import PlanError, StateError
from zephon.exec.pipeline import LanePipeline
from zephon.exec.state import LaneState
from zephon.exec.steps import leaf_sources
from zephon.exec.windows import Window
from zephon.ops.base import Transform
from zephon.ops.mix import PerSource
from zephon.plan import Mix
from zephon.sources.base import Columns

#: `(branch, count) -> the lane's next `count` unused rows of that branch (fewer if it ended)`
Peek = Callable[[int, int], list[tuple[Window, int]]]


@dataclass(frozen=True)
class TokenSchedule:
    """A lane's deficit schedule over the branches of a token mix."""

    starts: tuple[int, ...]  # the step each set of weights applies from: 0, then the schedule's
    #: per set, the integer a branch's count is multiplied by to compare it with the others
    #: (lcm / weight, with the weights made exact integers; None for a weight of 0: never chosen).
    #: Counting in Python integers keeps the deficit exact at any count: in float64 two counts
    #: past 2**53 compare equal and the mix collapses onto one branch.
    scales: tuple[tuple[int | None, ...], ...]
    count_field: str | None  # None: a mix by samples read whole (every record counts one)
    mask_field: str | None = None  # a mix by trained tokens: count the mask's non-zero tokens
    read_all: bool = False  # Mix(stop="all"): an exhausted branch drops out, the others go on

    @staticmethod
    def of(mix: Mix) -> TokenSchedule:
        sets = [mix.weights] + [w for _, w in mix.schedule]
        return TokenSchedule((0,) + tuple(s for s, _ in mix.schedule), tuple(_scales(w) for w in sets),
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
        if self.count_field is None:
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
        child whole, when every branch with a weight ran out (until then the exhausted ones drop
        out and the rest keep their relative weights)."""
        scales = self.scales[bisect.bisect_right(self.starts, step) - 1]
        live = [b for b, m in enumerate(scales) if m is not None]
        keys = [int(c) * (m or 0) for c, m in zip(mix, scales)]
        nb = len(keys)
        depth = [0] * nb
        peeked: list[list[tuple[Window, int]]] = [[] for _ in range(nb)]
        rows: list[tuple[Window, int]] = []
        branches: list[int] = []
        while len(rows) < count and live:
            b = min(live, key=keys.__getitem__)  # the branch furthest behind; ties: the lowest
            if depth[b] == len(peeked[b]):
                peeked[b] = peek(b, depth[b] + max(4, count))
                if depth[b] == len(peeked[b]):
                    if not self.read_all:
                        break
                    live.remove(b)
                    continue
            win, r = peeked[b][depth[b]]
            depth[b] += 1
            rows.append((win, r))
            branches.append(b)
            keys[b] += self.count(win.cols, r) * (scales[b] or 0)
        return rows, branches


def _scales(weights: Sequence[float]) -> tuple[int | None, ...]:
    """Per branch `lcm / weight` over the weights as exact integers (a float is an exact binary
    fraction), so `count × scale` orders branches as `count / weight` does, without rounding."""
    exact = [Fraction(w) for w in weights]
    den = math.lcm(*(f.denominator for f in exact))
    ints = [int(f * den) for f in exact]
    top = math.lcm(*(i for i in ints if i > 0))
    return tuple(top // i if i > 0 else None for i in ints)


def _chain(pipeline: LanePipeline, sid: int) -> list[Transform]:
    """The row operators the records of source `sid` go through, in order."""
    out: list[Transform] = []
    for t in pipeline.rows:
        out += list(t.chains.get(sid, ())) if isinstance(t, PerSource) else [t]
    return out


def _counts_each(mix: Mix, chain: Sequence[Transform]) -> tuple[int, int | None]:
    """What one record of this chain counts: (at least, at most or None when unknown)."""
    if not mix.by_tokens:
        return 1, 1  # read whole by samples: every record counts one
    if mix.by != "tokens" or not chain:
        return 0, None  # trained tokens: a record may train on none of its tokens
    from zephon.ops.tokenize import Tokenize  # here: the core loads it only for a token mix

    last = chain[-1]  # the operator that wrote the counted column last
    if not isinstance(last, Tokenize) or last.output != mix.count_field:
        return 0, None
    cut = last.max_tokens if last.overflow == "truncate" else None  # (split: not one-to-one)
    return (1 if last.bos is not None or last.eos is not None else 0), cut


def check_counters(mix: Mix, pipeline: LanePipeline, step: int, lanes: Iterable[tuple[int, LaneState]]) -> None:
    """Refuses lanes whose mix counters cannot agree with their cursors.

    A lane's counter of branch b sums what each record it consumed from b counted since the
    last weight change; its cursor says how many inputs of b it consumed since step 0. When no
    weight change lies before `step` and every input of b gives exactly one record (one-to-one
    row operators), the inputs consumed bound the counter: by samples it equals them; by tokens
    it is at least them when the branch's `Tokenize` adds BOS/EOS (writing the counted column
    last), and at most `max_tokens` times them when that Tokenize truncates. Where no bound is
    known (filters, split documents, trained tokens, a weight change) nothing is refused.
    """
    if any(s < step for s, _ in mix.schedule):  # the counters restarted at a weight change
        return
    bounds: list[tuple[int, int | None] | None] = []  # per branch: per input (at least, at most)
    for child in mix.children:
        chains = [_chain(pipeline, sid) for sid in sorted({s.id for s in leaf_sources(child)})]
        each = [_counts_each(mix, c) for c in chains]
        if not chains or not all(t.one_to_one for c in chains for t in c):
            bounds.append(None)
            continue
        tops = [hi for _, hi in each]
        bounds.append((min(lo for lo, _ in each), None if None in tops else max(t for t in tops if t is not None)))
    what = "tokens" if mix.by_tokens else "records"
    for lane, st in lanes:
        for b, (m, bound) in enumerate(zip(st.mix, bounds)):
            if bound is None:
                continue
            consumed = st.cursor[b] + (st.skip[b] > 0)  # a partly used input was consumed
            lo, hi = consumed * bound[0], None if bound[1] is None else consumed * bound[1]
            if lo <= m and (hi is None or m <= hi):
                continue
            if lo == hi:
                need = f"exactly {lo}: a mix by samples counts one per record"
            elif m < lo:
                need = f"at least {lo}: every record of it counts at least one token (its Tokenize adds BOS/EOS)"
            else:
                need = f"at most {hi}: its Tokenize truncates every record to {bound[1]} tokens"
            raise StateError(f"lane {lane} of the state counts {m} {what} of source branch {b} ('mix') "
                             f"after consuming {consumed} of its inputs ('cursor'); the counter must be "
                             f"{need}. The state was edited or its counters come from another run: "
                             "restore the checkpoint as save_state wrote it.")

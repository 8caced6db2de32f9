"""The token-mix schedule: which source a lane reads next when a `Mix` counts tokens.

A `Mix(by="tokens")` cannot be resolved by the algebra (how many tokens a record holds is known
only after the pipeline ran), so each lane follows it during assembly: the next input comes from
the branch furthest behind its weight, counted in tokens, ties to the lower branch. Its own
module because it is a rule of the data (the lane's `mix` counters in a checkpoint are its state)
rather than of how the engine fetches windows.

A weight schedule (`Mix(schedule=...)`, a curriculum) changes the weights at given steps; at each
such step the lane's counters start from zero, so the lane follows the new weights from there as
closely as from step 0. The counters in a checkpoint are therefore those since the last change.

Terms (docs/glossary.md): branch, lane.
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
from zephon.exec.windows import Window
from zephon.ops.base import Transform
from zephon.ops.mix import PerSource
from zephon.plan import Mix
from zephon.plan.walk import leaf_sources
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


#: A mix counter at or past this is refused whatever the pipeline: counts compared as floats
#: (by any tool reading the state) stop being exact there, and no run reads 2**53 tokens per lane.
MAX_COUNTER = 2**53


def _bounds(mix: Mix, pipeline: LanePipeline, child: object) -> tuple[int, int | None] | None:
    """What one consumed input of a branch counts: (at least, at most or None); None when
    nothing is known (an operator may make several records of one input)."""
    chains = [_chain(pipeline, sid) for sid in sorted({s.id for s in leaf_sources(child)})]  # type: ignore[arg-type]
    if not chains or any(t.expands for c in chains for t in c):
        return None
    each = [_counts_each(mix, c) for c in chains]
    # an input gives at most one record; only one-to-one chains give exactly one (a lower bound)
    lo = min(lo for lo, _ in each) if all(t.one_to_one for c in chains for t in c) else 0
    tops = [hi for _, hi in each]
    return lo, None if None in tops else max(t for t in tops if t is not None)


def check_counters(mix: Mix, pipeline: LanePipeline, step: int, lanes: Iterable[tuple[int, LaneState]]) -> None:
    """Refuses lanes whose mix counters cannot agree with their cursors.

    A lane's counter of branch b sums what each record it consumed from b counted since the
    last weight change; its cursor says how many inputs of b it consumed since step 0. Where
    every input of b gives at most one record (row operators that keep or drop it: maps,
    filters, a truncating `Tokenize`), the inputs consumed bound the counter from above: by
    samples one per input, by tokens `max_tokens` per input when the branch's `Tokenize`
    (writing the counted column last) truncates — at any step, since a weight change only
    restarts the counter. From below, when no weight change lies before `step` and every input
    gives exactly one record (one-to-one): by samples the counter equals the inputs, by tokens
    it is at least them when the Tokenize adds BOS/EOS. A counter at or past 2**53
    (`MAX_COUNTER`) is always refused. Where no bound is known (split documents, flat maps,
    trained tokens, a tokenizer that does not truncate) only that limit applies.
    """
    restarted = any(s < step for s, _ in mix.schedule)  # the counters restarted at a weight change
    bounds = [_bounds(mix, pipeline, child) for child in mix.children]
    what = "tokens" if mix.by_tokens else "records"
    for lane, st in lanes:
        for b, (m, bound) in enumerate(zip(st.mix, bounds)):
            consumed = st.cursor[b] + (st.skip[b] > 0)  # a partly used input was consumed
            lo = 0 if restarted or bound is None else consumed * bound[0]
            hi = None if bound is None or bound[1] is None else consumed * bound[1]
            if lo <= m and (hi is None or m <= hi):
                if m < MAX_COUNTER:
                    continue
                raise StateError(f"lane {lane} of the state counts {m} {what} of source branch {b} ('mix') "
                                 f"after consuming {consumed} of its inputs ('cursor'): at or beyond "
                                 f"2**53, more than any run reads. The state was edited or is corrupt: "
                                 "restore the checkpoint as save_state wrote it.")
            assert bound is not None
            if lo == hi:
                need = f"exactly {lo}: a mix by samples counts one per record"
            elif m < lo:
                need = f"at least {lo}: every record of it counts at least one token (its Tokenize adds BOS/EOS)"
            elif not mix.by_tokens:
                need = f"at most {hi}: a mix by samples counts one per record, and each input gives at most one"
            else:
                need = (f"at most {hi}: its Tokenize truncates every record to {bound[1]} tokens, and "
                        "each input gives at most one record")
            raise StateError(f"lane {lane} of the state counts {m} {what} of source branch {b} ('mix') "
                             f"after consuming {consumed} of its inputs ('cursor'); the counter must be "
                             f"{need}. The state was edited or its counters come from another run: "
                             "restore the checkpoint as save_state wrote it.")

"""`Batching`: the plan's root — global batch k holds B(k)/lanes outputs of every lane, lane-major.

This is where lane positions become rows of a global batch (and, with a `remainder`, where a
finite plan ends). "Batch" in Zephon means the emitted batch; this node is the rule that makes
it, so it is called `Batching` (its kind in plan JSON stays "Batch": fingerprints never change).

Terms (docs/glossary.md): `Batching`, global batch, step, remainder.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from zephon.errors import PlanError
from zephon.plan.batchsizes import BatchSizes, parse_schedule
from zephon.plan.blockshuffle import resolve_window
from zephon.plan.lanes import Lanes, Remainder
from zephon.plan.node import MAX_POSITION, Node, check_int
from zephon.plan.refs import Refs

__all__ = ["Batching"]


@dataclass(frozen=True)
class Batching(Node, kind="Batch"):
    """The plan's root: global batch k holds B(k)/lanes outputs of every lane, lane-major.

    Built by `stream.lanes(L).batch(B)`. Its kind in plan JSON stays "Batch" (the name it had
    before 0.4), so every saved plan, state and fingerprint reads as before.

    `size` is B from step 0; `schedule` lists `(step, size)` changes after it (a ramp-up).
    With `p = B(k)/L` and `o(k) = Σ_{j<k} B(j)/L` (`zephon.plan.batchsizes`), row j of batch k is
    output `o(k) + j % p` of lane `j // p`.

    `remainder` decides the end of a finite plan, the same at every data-parallel degree:
    "drop" ends at the last step every lane fills (records past it are not emitted); "pad"
    deals every position into the lanes and ends at the last step any lane has an output for,
    lanes that ran out filling their rows with zeros, and adds a boolean field `valid` (False on
    those rows): every record — packed, every token — is emitted exactly once. "auto" (the
    default) is decided by the `Loader`: "pad" for a finite pipeline that changes the number of
    records (filters, tokenize + pack, a mix by tokens: its lanes run out at different steps, and
    dropping would lose whole lanes' tails), "drop" otherwise (one-to-one: less than one global
    batch is left over, as PyTorch's `drop_last`). A loader's state records the plan it resolved,
    so checkpoints of plans that drop keep their fingerprint (JSON without "remainder": "drop").
    """

    child: Lanes
    size: int
    schedule: tuple[tuple[int, int], ...] = ()
    remainder: Remainder = "auto"
    #: JSON without "remainder" is a plan that drops (written before "auto", or by a loader)
    json_absent: ClassVar[dict[str, Any]] = {"remainder": "drop"}

    def __post_init__(self) -> None:
        if self.remainder not in ("auto", "drop", "pad"):
            raise PlanError(f"Batching remainder must be 'auto', 'drop' or 'pad', got {self.remainder!r}")
        if not isinstance(self.child, Lanes):
            raise PlanError("Batching (the plan's root) must wrap a Lanes node: build plans as "
                            "stream.lanes(L).batch(B) (B divisible by L).")
        check_int("Batching.size", self.size, 1)
        entries = parse_schedule(self.schedule)
        if any(step < 1 for step, _ in entries):
            raise PlanError(f"Batching.schedule lists changes from step 1 on (Batching.size is step 0's), got "
                            f"{entries}; build it with .batch(schedule=((0, B0), (k1, B1), ...)).")
        object.__setattr__(self, "schedule", tuple(entries))
        BatchSizes(self.child.count, self.size, self.schedule)  # checks the sizes
        biggest = max([self.size, *(s for _, s in self.schedule)])
        lanes = resolve_window(self.child, self.child.count, biggest)  # block shuffles' "auto"
        if lanes is not self.child:
            object.__setattr__(self, "child", lanes)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if not self.schedule:  # plans with one size keep the fingerprints they always had
            del out["schedule"]
        else:
            out["schedule"] = [list(e) for e in self.schedule]
        if self.remainder == "drop":  # and plans that drop the remainder
            del out["remainder"]
        return out

    @property
    def lanes(self) -> Lanes:  # type: ignore[override]
        return self.child

    @functools.cached_property
    def sizes(self) -> BatchSizes:
        """The global batch size of every step (vectorised lookups and prefix sums)."""
        return BatchSizes(self.child.count, self.size, self.schedule)

    @property
    def per_lane(self) -> int:
        """Outputs every lane gives a step — of a plan with one batch size."""
        if self.schedule:
            raise PlanError("this plan has a batch-size schedule, so a lane's share of a batch depends "
                            "on the step: use per_lane_at(step) / size_at(step).")
        return self.size // self.child.count

    def per_lane_at(self, step: int) -> int:
        """Outputs every lane gives step `step`: `B(step) / lanes`."""
        return int(self.sizes.per_lane(step))

    def size_at(self, step: int) -> int:
        """The global batch size of step `step`."""
        return self.per_lane_at(step) * self.child.count

    def lane_offset(self, step: int) -> int:
        """Outputs every lane gave steps before `step` (where step `step` starts in every lane)."""
        return int(self.sizes.offset(step))

    def tokens_before(self, step: int, seq_len: int) -> int:
        """Tokens of the steps before `step`, for rows of `seq_len` tokens (packed rows)."""
        return self.lane_offset(step) * self.child.count * seq_len

    @property
    def pad(self) -> bool:
        return self.remainder == "pad"

    @property
    def length(self) -> int | None:
        """Number of global batches of a one-to-one pipeline; None if infinite (or if the
        plan's lanes are followed in sequence, like a mix by tokens: the data decides)."""
        return self.steps_over(0)

    def steps_over(self, shift: int) -> int | None:
        """Steps of a one-to-one pipeline whose lane positions are moved by `shift` (a run
        resumed at another batch size): whole steps dropping, steps with any row padding."""
        if self.pad:
            lim = self.child.lane_limits(np.arange(self.child.count), 0, pad=True)
            if lim is None or len(self.child.branches) > 1:
                return None
            most = int(lim.max()) - shift
            k = self.sizes.steps_within(most)
            return k + int(int(self.sizes.offset(k)) < most)
        n = self.child.lane_length()
        return None if n is None else self.sizes.steps_within(n - shift)

    num_steps = length

    @property
    def max_step(self) -> int:
        """The largest step a plan addresses: `step × size` (the largest size of a schedule)
        stays below `MAX_POSITION`, so no position computed from a step wraps round in int64."""
        return MAX_POSITION // max([self.size] + [b for _, b in self.schedule]) - 1

    def check_step(self, step: Any, what: str = "step") -> int:
        """`step` as an int if it is one this plan addresses, else a PlanError saying why."""
        _check_step(step, what)
        if step > self.max_step:
            raise PlanError(f"{what} {step} is beyond the last step this plan addresses, "
                            f"{self.max_step} (2**62 // the largest batch size, - 1): positions past "
                            "2**62 would wrap round in int64 to the first steps' data.")
        return int(step)

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        return self.child._resolve(pos, epoch)

    def rows(self, step: int, lanes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(lane, lane output index) of every row of batch `step` that `lanes` own (default all).

        Rows come in global row order restricted to those lanes.
        """
        self.check_step(step)
        lanes = np.arange(self.child.count, dtype=np.int64) if lanes is None else np.asarray(lanes, np.int64)
        lane, index, _ = self.sizes.rows(np.array([step], np.int64), lanes)
        return lane, index

    def refs(self, step: int, lanes: np.ndarray | None = None) -> Refs:
        """Record references of batch `step`'s rows (restricted to `lanes`) for 1:1 pipelines."""
        step = self.check_step(step)
        n = self.length
        if n is not None and step >= n:
            raise PlanError(f"step {step} is past the end of the plan ({n} global batches)")
        if len(self.child.branches) > 1:
            raise PlanError("a Mix by tokens has no order by position: which record fills a row "
                            "depends on the token counts before it. Iterate a Loader and use "
                            "LocalBatch.explain() (or `zephon explain MODULE:FACTORY --step K`).")
        lane, index = self.rows(step, lanes)
        if self.pad:  # rows past a lane's end are padding: no record (source -1)
            ok = index < self.child.lane_limits(lane, 0, pad=True)
            refs = self.child.resolve_lanes(lane[ok], index[ok])
            full = np.full(len(lane), -1, np.int64)
            cols = []
            for v in (refs.source, refs.record, refs.epoch):
                c = full.copy()
                c[ok] = v
                cols.append(c)
            return Refs(cols[0], cols[1], cols[2])
        return self.child.resolve_lanes(lane, index)

    def explain(self, step: int) -> list[dict[str, int]]:
        """For every row of global batch `step`: row, lane, source, record, epoch."""
        lane, _ = self.rows(step)
        r = self.refs(step)
        return [{"row": j, "lane": int(lane[j]), "source": int(r.source[j]),
                 "record": int(r.record[j]), "epoch": int(r.epoch[j])} for j in range(len(lane))]

    def explain_text(self, step: int) -> str:
        rows = self.explain(step)
        head = f"{'row':>5} {'lane':>5} {'source':>6} {'record':>14} {'epoch':>6}"
        return "\n".join([head] + [f"{r['row']:>5} {r['lane']:>5} {r['source']:>6} {r['record']:>14} "
                                    f"{r['epoch']:>6}" for r in rows])


def _check_step(step: Any, what: str = "step") -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise PlanError(f"{what} must be an integer, got {step!r}")
    if step < 0:
        raise PlanError(f"{what} must be non-negative, got {step}; steps count global batches from 0.")

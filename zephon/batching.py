"""The plan's root: `Lanes` deals a stream into canonical lanes, `Batch` lays them side by side.

Lanes are the unit of state and of data-parallel ownership: rank r of D owns a fixed set of them
(`check_degree` says which D a plan allows), and global batch k holds `size / lanes` outputs of
every lane, lane-major, so the global batch is the same for every D. Its own module because this
is where positions become rows and ranks; the streams below it are `zephon.plan` and
`zephon.mixing`, and `zephon.plan` re-exports these names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from zephon.batchsize import BatchSizes, parse_schedule, steps_from_tokens
from zephon.errors import PlanError
from zephon.mixing import Mix, _gather_children
from zephon.plan import MAX_POSITION, Mapping, Node, Refs, _check_int


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
        _check_int("Lanes.count", self.count, 1)
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
              remainder: Remainder = "auto") -> Batch:
        """The plan's root: global batches of `size` rows, `size / count` from every lane;
        `remainder` ("auto", "drop" or "pad") decides the end of a finite plan (see `Batch`).

        Or a batch-size `schedule` (a ramp-up), part of the plan: `((0, 256), (2000, 512), ...)`
        — from step 0 256 rows, from step 2000 512, ... With `by="tokens"` the first numbers are
        tokens seen (rows of `seq_len` tokens, e.g. packed), converted to steps by
        `zephon.batchsize.steps_from_tokens`. Every size must be a multiple of `count`.
        """
        if schedule is None:
            if by != "steps" or seq_len is not None:
                raise PlanError("by= and seq_len= describe a schedule: pass schedule=((0, B0), (t1, B1), ...)")
            if size is None:
                raise PlanError("batch() needs a size, e.g. .batch(256), or schedule=((0, 256), (2000, 512))")
            return Batch(self, size, remainder=remainder)
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
        return Batch(self, entries[0][1], tuple(entries[1:]), remainder)

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
            return _gather_children(self.child.children, which, pos, np.full_like(pos, epoch))
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
    from zephon.errors import check_positive_int, divisors

    world = check_positive_int(world, "the data-parallel degree")
    if lanes % world:
        raise PlanError(f"lanes={lanes} is not divisible by the data-parallel degree {world}; "
                        f"run with a degree in {divisors(lanes)}, or build the plan with a lane count that "
                        f"every degree you will use divides (e.g. lanes={math.lcm(lanes, world)}).")


Remainder = Literal["auto", "drop", "pad"]


@dataclass(frozen=True)
class Batch(Node, kind="Batch"):
    """The plan's root: global batch k holds B(k)/lanes outputs of every lane, lane-major.

    `size` is B from step 0; `schedule` lists `(step, size)` changes after it (a ramp-up).
    With `p = B(k)/L` and `o(k) = Σ_{j<k} B(j)/L` (`zephon.batchsize`), row j of batch k is
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
            raise PlanError(f"Batch remainder must be 'auto', 'drop' or 'pad', got {self.remainder!r}")
        if not isinstance(self.child, Lanes):
            raise PlanError("Batch must wrap a Lanes node: build plans as "
                            "stream.lanes(L).batch(B) (B divisible by L).")
        _check_int("Batch.size", self.size, 1)
        entries = parse_schedule(self.schedule)
        if any(step < 1 for step, _ in entries):
            raise PlanError(f"Batch.schedule lists changes from step 1 on (Batch.size is step 0's), got "
                            f"{entries}; build it with .batch(schedule=((0, B0), (k1, B1), ...)).")
        object.__setattr__(self, "schedule", tuple(entries))
        BatchSizes(self.child.count, self.size, self.schedule)  # checks the sizes
        from zephon.blockshuffle import resolve_window  # (it imports zephon.plan, which imports us)

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

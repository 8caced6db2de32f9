"""How well a plan shuffles, in numbers that predict training: `shuffle_quality(plan)`.

A shuffle's job is that a global batch looks like an independent sample of the data. Blocks of
consecutive records are often alike (one shard, one source, one topic), so what matters is how
often two rows of one batch come from one block:

- `p_same` — the probability that two rows of one global batch come from the same block of
  `block` consecutive records, measured over sample batches of the plan. A full shuffle gives
  about `block / n`; a block shuffle with windows of `W` blocks about `1 / W`.
- `effective_batch` — if rows of one block have intra-block correlation `rho`, a batch of `B`
  rows carries the information of `B / (1 + (B - 1) · p_same · rho)` independent rows (the
  design effect of cluster sampling). `rho` is a property of the data (0: blocks are no more
  alike than random rows; 1: a block is one row repeated); pass your own.
- displacement and inversion statistics of one epoch's order, next to a full shuffle's over the
  same records: `displacement` (mean |position − record| / n; a full shuffle ≈ 1/3),
  `inversions` (the fraction of position pairs out of record order; ≈ 1/2), and `neighbours`
  (the chance that records r and r + 1 land in one global batch; a full shuffle ≈ (B−1)/(n−1)).
  Displacement and inversions say whether the order is far from the data's; `neighbours` and
  `p_same` say whether the data's local structure survives into batches, which is what costs
  quality (see the A/B in docs/object-storage.md).

`zephon explain PLAN --quality` prints it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.plan.batching import Batching
from zephon.plan.blockshuffle import block_shuffles
from zephon.plan.shuffle import Shuffle
from zephon.plan.source import Source

_MAX_EPOCH_SAMPLE = 1 << 20


@dataclass(frozen=True)
class ShuffleQuality:
    """See the module doc. `*_full` are a full shuffle's values over the same data."""

    batch: int
    block: int
    window: int | None
    steps: int
    p_same: float
    p_same_full: float
    rho: float
    effective_batch: float
    effective_batch_full: float
    displacement: float
    displacement_full: float
    inversions: float
    inversions_full: float
    neighbours: float
    neighbours_full: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        w = f", windows of {self.window} blocks (1/W = {1 / self.window:.2e})" if self.window else ""
        return "\n".join([
            f"shuffle quality over {self.steps} global batches of {self.batch} rows; blocks of "
            f"{self.block} records{w}",
            f"{'':28}{'this plan':>14}{'full shuffle':>14}",
            f"{'P(same block) in a batch':28}{self.p_same:>14.3e}{self.p_same_full:>14.3e}",
            f"{f'effective batch (rho={self.rho:g})':28}{self.effective_batch:>14.1f}"
            f"{self.effective_batch_full:>14.1f}",
            f"{'displacement / n':28}{self.displacement:>14.3f}{self.displacement_full:>14.3f}",
            f"{'inversions':28}{self.inversions:>14.3f}{self.inversions_full:>14.3f}",
            f"{'neighbours in one batch':28}{self.neighbours:>14.3e}{self.neighbours_full:>14.3e}",
        ])


def effective_batch(batch: int, p_same: float, rho: float) -> float:
    """B / (1 + (B − 1) · p_same · rho): independent rows a batch is worth."""
    return batch / (1.0 + (batch - 1) * p_same * rho)


def p_same_block(keys: np.ndarray) -> float:
    """The fraction of pairs of rows with equal block keys (one batch's rows)."""
    n = len(keys)
    if n < 2:
        return 0.0
    _, counts = np.unique(keys, return_counts=True, axis=0 if keys.ndim > 1 else None)
    return float((counts * (counts - 1)).sum() / (n * (n - 1)))


def shuffle_quality(plan: Any, block: int | None = None, rho: float = 0.1, steps: int = 16,
                    seed: int = 0) -> ShuffleQuality:
    """The quality report of a one-to-one plan (a `Batching` root): see the module doc.

    `block` is the block size in records that `p_same` is about (default: the plan's block
    shuffle's). `steps` global batches spread over the plan's first epoch are measured.
    """
    if not isinstance(plan, Batching):
        raise PlanError("shuffle_quality needs a complete plan (stream.lanes(L).batch(B))")
    nodes = block_shuffles(plan)
    window = None
    if nodes:
        if any(not n.resolved for n in nodes):
            raise PlanError("resolve the block shuffle's block='auto' first (a Loader's .plan, or "
                            "zephon.plan.blockshuffle.resolve_blocks(plan, sources)), or give block=")
        if block is None:
            block = int(nodes[0].block)
        window = int(nodes[0].window)
    if block is None:
        raise PlanError("this plan has no block shuffle: pass block= (records per block) to say "
                        "which blocks P(same block) is about, e.g. block=256")
    if not 0 <= rho <= 1:
        raise PlanError(f"rho is a correlation in [0, 1], got {rho}")
    stream = plan.lanes.child
    n = stream.period or stream.length
    if n is None:
        raise PlanError("shuffle_quality needs a stream with an epoch length (a finite or repeated one)")
    size = plan.size
    total = plan.num_steps
    last = (n // size) if total is None else min(total, n // size)
    picks = np.unique(np.linspace(0, max(0, last - 1), num=min(steps, max(1, last))).astype(np.int64))

    def batch_keys(step: int) -> np.ndarray:
        r = plan.refs(int(step))
        return np.stack([r.source, r.epoch, r.record // block], axis=1)

    p_same = float(np.mean([p_same_block(batch_keys(s)) for s in picks]))
    full = Source(n).shuffle(seed + 1)
    full_keys = [full.resolve(np.arange(s * size, (s + 1) * size)).record // block for s in picks]
    p_full = float(np.mean([p_same_block(k) for k in full_keys]))
    m = min(n, _MAX_EPOCH_SAMPLE)
    pos = np.arange(m, dtype=np.int64) if m == n else np.sort(
        np.random.default_rng(seed).choice(n, m, replace=False))
    rec = stream.resolve(pos).record
    rec_full = Shuffle(Source(n), seed + 1).resolve(pos).record
    return ShuffleQuality(
        batch=size, block=block, window=window, steps=len(picks), p_same=p_same, p_same_full=p_full,
        rho=rho, effective_batch=effective_batch(size, p_same, rho),
        effective_batch_full=effective_batch(size, p_full, rho),
        displacement=_displacement(pos, rec, n), displacement_full=_displacement(pos, rec_full, n),
        inversions=_inversions(rec, seed), inversions_full=_inversions(rec_full, seed),
        neighbours=_neighbours(pos, rec, n, size), neighbours_full=_neighbours(pos, rec_full, n, size))


def _displacement(pos: np.ndarray, rec: np.ndarray, n: int) -> float:
    return float(np.mean(np.abs(pos - rec)) / n)


def _inversions(rec: np.ndarray, seed: int, pairs: int = 200_000) -> float:
    """Fraction of position pairs (i < j) with rec[i] > rec[j], from sampled pairs."""
    if len(rec) < 2:
        return 0.0
    rng = np.random.default_rng(seed + 7)
    i, j = rng.integers(0, len(rec), pairs), rng.integers(0, len(rec), pairs)
    keep = i != j
    i, j = np.minimum(i[keep], j[keep]), np.maximum(i[keep], j[keep])
    return float(np.mean(rec[i] > rec[j]))


def _neighbours(pos: np.ndarray, rec: np.ndarray, n: int, size: int) -> float:
    """P(records r and r + 1 sit in one global batch of `size` consecutive stream positions)."""
    where = np.full(n, -1, np.int64)
    where[rec] = pos // size
    a, b = where[:-1], where[1:]
    seen = (a >= 0) & (b >= 0)
    return float(np.mean(a[seen] == b[seen])) if seen.any() else 0.0

"""Grain's record order as Zephon plan nodes: same seed, same records, same positions.

Grain computes its order with a handful of pure index functions: `MapDataset.shuffle` maps an
index through `index_shuffle` (a 4-round Simon block cipher with cycle-walking, re-keyed per
epoch with `seed + epoch`), `MapDataset.mix` selects `(dataset, key)` by integer arithmetic on
the proportions, and `IndexSampler` shuffles each shard's contiguous range the same way. This
module re-implements the mix and sampler arithmetic vectorised in numpy (the cipher is
`index_shuffle`) and wraps them as plan nodes, so a Zephon plan can name exactly the records
Grain would, at O(len(positions)) cost. `tests/test_compat_grain_order.py` checks the nodes
against real Grain pipelines.

Index convention. Grain passes one integer index down its dataset tree; an index past the end of
a finite dataset means "a later epoch" (`epoch, i = divmod(index, len)`). Zephon passes
`(position, epoch)` pairs. For every node here the Grain index of a pair is
`epoch * length + position` (just `position` for infinite streams); Zephon's `Repeat` and `Slice`
preserve this correspondence, which is why they need no Grain twin.

Loading a plan that contains these nodes with `Node.from_json` requires importing this module
(`import zephon.compat.grain`) first: nodes register themselves by class name on import.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zephon.errors import PlanError, check_positive_int
from zephon.plan import Node, PassThrough, Refs
from zephon.plan.mix import gather_children

from .cipher import index_shuffle

GRAIN_INFINITE = sys.maxsize
"""`len()` of an infinite Grain dataset (Grain's own convention)."""


def grain_index_column(tag: int) -> str:
    """The `Refs.extra` column in which `GrainIndex(tag)` records each row's Grain index."""
    return f"grain_index/{int(tag)}"


def _grain_index(pos: np.ndarray, epoch: np.ndarray, length: int | None) -> np.ndarray:
    return pos if length is None else epoch * length + pos


def _split(index: np.ndarray, length: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Grain index -> Zephon (position, epoch) for a child of `length` (None: infinite)."""
    if length is None:
        return index, np.zeros_like(index)
    epoch, pos = np.divmod(index, length)
    return pos, epoch


def _positive(node: Node, *names: str) -> None:
    for name in names:
        check_positive_int(getattr(node, name), f"{type(node).__name__}.{name}")


def _grain_len(node: Node) -> int:
    n = node.length
    return GRAIN_INFINITE if n is None else n


@dataclass(frozen=True)
class GrainIndex(PassThrough):
    """Transparent node that records each row's Grain index at this depth under `tag`.

    `MapWithIndex` and Grain-exact `RandomMap` need the element's index at their own depth of
    the Grain pipeline; it rides along with the references as the extra column
    `grain_index_column(tag)` (through every node, filter and mix, like any `Refs.extra`).
    """

    child: Node
    tag: int

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        refs = self.child._resolve(pos, epoch)
        return refs.with_extra(grain_index_column(self.tag), _grain_index(pos, epoch, self.child.length))


# --- MapDataset.shuffle and MapDataset.mix ---------------------------------------------------

@dataclass(frozen=True)
class GrainShuffle(PassThrough):
    """`MapDataset.shuffle(seed)`: index_shuffle within each epoch, keyed `(seed + epoch) % 2**32`.

    Over an infinite child Grain shuffles the whole `sys.maxsize` index space, and so does this.
    """

    child: Node
    seed: int

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not (
                0 <= self.seed < 2 ** 32):
            raise PlanError(f"Grain shuffle seeds are integers in [0, 2**32), got {self.seed!r}")

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        n = _grain_len(self.child)
        e, inner = np.divmod(_grain_index(pos, epoch, self.child.length), n)
        seeds = (self.seed + e) % (1 << 32)
        return self.child._resolve(index_shuffle(inner, n - 1, seeds), e)


def mix_selection(index: np.ndarray, proportions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Grain's `_dataset_and_key_of_next_element` for an array of mixed-stream indices.

    Returns (dataset number, index within that dataset). Exact integer arithmetic: int64 while
    `index * sum(proportions)` fits, Python integers beyond.
    """
    k = np.asarray(index, dtype=np.int64)
    total = int(sum(proportions))
    if k.size and int(k.max()) + 1 > (1 << 62) // max(total, 1):
        k = k.astype(object)
    which = np.full(k.shape, -1, np.int64)
    key = np.zeros(k.shape, np.int64)
    remaining = total
    cur, cur1 = k, k + 1
    for i, p in enumerate(proportions):
        nxt = (cur * (remaining - p)) // remaining
        nxt1 = (cur1 * (remaining - p)) // remaining
        count1 = cur1 - nxt1
        hit = ((cur - nxt) != count1) & (which < 0)
        which[hit] = i
        key[hit] = np.asarray(count1[hit] - 1, dtype=np.int64)
        remaining -= p
        cur, cur1 = nxt, nxt1
    if (which < 0).any():
        raise PlanError("Grain mix selection found no dataset for some index; the proportions "
                        f"{list(proportions)} must all be positive integers.")
    return which, key


def grain_proportions(weights: Sequence[float] | None, count: int) -> tuple[int, ...]:
    """Grain's integer proportions: 1 each by default, else scaled so the smallest is 100."""
    if weights is None:
        return (1,) * count
    w = [float(x) for x in weights]
    if len(w) != count:
        raise PlanError(f"mix got {count} datasets but {len(w)} weights; give one weight per dataset.")
    if 0 in w or any(not math.isfinite(x) or x < 0 for x in w):
        raise PlanError(f"mix weights must be positive and finite (Grain rejects zeros), got {w}")
    scale = 100 / min(w)
    return tuple(int(x * scale) for x in w)


@dataclass(frozen=True)
class GrainMix(Node):
    """`MapDataset.mix(children, weights)` with Grain's selection and Grain's length."""

    children: tuple[Node, ...]
    proportions: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.children or len(self.children) != len(self.proportions):
            raise PlanError("GrainMix needs one positive integer proportion per child; build it "
                            "with Dataset.mix(...) or grain_proportions().")
        if any(isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p <= 0
               for p in self.proportions):
            raise PlanError(f"GrainMix proportions must be positive integers, got {list(self.proportions)}")

    @property
    def length(self) -> int | None:
        total = sum(self.proportions)
        lengths = [_grain_len(c) / (p / total) for c, p in zip(self.children, self.proportions)]
        n = min(GRAIN_INFINITE, int(min(lengths)))
        return None if n >= GRAIN_INFINITE else n

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        which, key = mix_selection(_grain_index(pos, epoch, self.length), self.proportions)
        inner, ep = key.copy(), np.zeros_like(key)
        for i, c in enumerate(self.children):
            m = which == i
            inner[m], ep[m] = _split(key[m], c.length)
        return gather_children(self.children, which, inner, ep)


# --- DataLoader + IndexSampler ----------------------------------------------------------------

def even_split(n: int, shard: np.ndarray, count: int, drop_remainder: bool) -> tuple[np.ndarray, np.ndarray]:
    """Grain's `sharding.even_split` for an array of shard indices: (start, end) per shard."""
    per = n // count
    start = per * shard
    end = per * (shard + 1)
    rem = n % count
    if rem and not drop_remainder:
        start = start + np.minimum(shard, rem)
        end = end + np.minimum(shard + 1, rem)
    return start, end


@dataclass(frozen=True)
class GrainSampler(Node):
    """`grain.samplers.IndexSampler`: position g is the sampler's global index g.

    Shard `g % shard_count` holds a contiguous range of the records (`even_split`); its local
    index `g // shard_count` runs over that range, shuffled per epoch with
    `index_shuffle(., len(range) - 1, (seed + epoch) % 2**32)` when `shuffle`. `shard_count`
    is the sampler's own (1 when the sampler is built with `NoSharding()`).
    """

    num_records: int
    shard_count: int = 1
    drop_remainder: bool = False
    # IndexSampler's own name; it shadows Node.shuffle() (never chained on a sampler) but renaming
    # it would change the plan's JSON key and so every saved plan's fingerprint
    shuffle: bool = False  # type: ignore[assignment]
    seed: int | None = None
    num_epochs: int | None = None

    def __post_init__(self) -> None:
        _positive(self, "num_records", "shard_count")
        if self.num_epochs is not None and (isinstance(self.num_epochs, bool) or self.num_epochs < 1):
            raise PlanError(f"GrainSampler.num_epochs must be None or >= 1, got {self.num_epochs!r}")
        if self.shuffle and self.seed is None:
            raise PlanError("a shuffling IndexSampler needs a seed (Grain raises the same); pass seed=.")
        if self.seed is not None and not 0 <= int(self.seed) < 2 ** 32:
            raise PlanError(f"IndexSampler seeds are 32-bit non-negative integers, got {self.seed!r}")
        if self.num_records < self.shard_count:
            raise PlanError(f"{self.num_records} records cannot be split into {self.shard_count} "
                            "non-empty shards; use fewer shards.")

    @property
    def length(self) -> int | None:
        if self.num_epochs is None:
            return None
        n = self.num_epochs * self.num_records
        if self.shard_count > 1 and self.drop_remainder:
            n = min(n, (self.num_records // self.shard_count) * self.shard_count * self.num_epochs)
        return n

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        g = _grain_index(pos, epoch, self.length)
        local, shard = np.divmod(g, self.shard_count)
        start, end = even_split(self.num_records, shard, self.shard_count, self.drop_remainder)
        size = end - start
        ep, inner = np.divmod(local, size)
        if self.shuffle:
            out = np.empty_like(inner)
            seeds = (int(self.seed) + ep) % (1 << 32)  # type: ignore[arg-type]
            for m in np.unique(size):
                rows = np.flatnonzero(size == m)
                out[rows] = index_shuffle(inner[rows], int(m) - 1, seeds[rows])
            inner = out
        return Refs(np.zeros_like(g), start + inner, ep)


@dataclass(frozen=True)
class GrainLoaderOrder(Node):
    """Lays `grain.DataLoader`'s batches out as one global, batch-major stream.

    The child is the sampler stream (global index g). Shard i of `shards` reads local indices
    j = 0, 1, ... with g = j * shards + i. With `workers` processes, worker w of a shard batches
    its local indices w, w + workers, ... and batches come out round-robin over workers. Global
    batch k of this stream is the concatenation over shards of each shard's batch k, so under
    `Lanes` with `shards` data-parallel ranks, rank i receives exactly Grain shard i's batch.
    """

    child: Node
    shards: int
    batch: int
    workers: int = 1

    def __post_init__(self) -> None:
        _positive(self, "shards", "batch", "workers")

    @property
    def length(self) -> int | None:
        n = self.child.length
        if n is None:
            return None
        batches_per_worker = ((n // self.shards) // self.workers) // self.batch
        return batches_per_worker * self.workers * self.shards * self.batch

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        q = _grain_index(pos, epoch, self.length)
        rows = self.shards * self.batch
        k, within = np.divmod(q, rows)
        shard, r = np.divmod(within, self.batch)
        kk, worker = np.divmod(k, self.workers)
        local = (kk * self.batch + r) * self.workers + worker
        return self.child._resolve(*_split(local * self.shards + shard, self.child.length))


@dataclass(frozen=True)
class ContiguousBatches(Node):
    """Deals a batch-major stream into lanes so that Zephon's lane-major batches equal it.

    Under `Lanes(ways)` with `ways * chunk` rows per batch, lane l takes rows
    [l*chunk, (l+1)*chunk) of each consecutive block of `ways * chunk` child positions. So global
    batch k is exactly child positions [k*B, (k+1)*B) in order, for every lane count, and each
    data-parallel rank still reads only its own lanes.
    """

    child: Node
    ways: int
    chunk: int

    def __post_init__(self) -> None:
        _positive(self, "ways", "chunk")

    @property
    def length(self) -> int | None:
        n = self.child.length
        block = self.ways * self.chunk
        return None if n is None else (n // block) * block

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        p = _grain_index(pos, epoch, self.length)
        idx, lane = np.divmod(p, self.ways)
        k, r = np.divmod(idx, self.chunk)
        q = (k * self.ways + lane) * self.chunk + r
        return self.child._resolve(*_split(q, self.child.length))

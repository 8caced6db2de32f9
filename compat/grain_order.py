"""Grain's record order as Zephon plan nodes: same seed, same records, same positions.

Grain computes its order with a handful of pure index functions: `MapDataset.shuffle` maps an
index through `index_shuffle` (a 4-round Simon block cipher with cycle-walking, re-keyed per
epoch with `seed + epoch`), `MapDataset.mix` selects `(dataset, key)` by integer arithmetic on
the proportions, and `IndexSampler` shuffles each shard's contiguous range the same way. This
module re-implements those functions *vectorised* in numpy (Grain's own `index_shuffle` binding
takes one scalar per call, ~25 µs each here) and wraps them as plan nodes, so a Zephon plan can
name exactly the records Grain would, at O(len(positions)) cost. `tests/test_grain_compat.py`
checks the numpy cipher against Grain's compiled one and the nodes against real Grain pipelines.

Index convention. Grain passes one integer index down its dataset tree; an index past the end of
a finite dataset means "a later epoch" (`epoch, i = divmod(index, len)`). Zephon passes
`(position, epoch)` pairs. For every node here the Grain index of a pair is
`epoch * length + position` (just `position` for infinite streams); Zephon's `Repeat` and `Slice`
preserve this correspondence, which is why they need no Grain twin.

Loading a plan that contains these nodes with `Node.from_json` requires importing this module
(`import zephon.compat.grain`) first: nodes register themselves by class name on import.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from zephon.errors import PlanError
from zephon.plan import Node, PassThrough, Refs

GRAIN_INFINITE = sys.maxsize
"""`len()` of an infinite Grain dataset (Grain's own convention)."""

_U32 = 0xFFFFFFFF
_ROUNDS = 4  # Grain always calls index_shuffle with rounds=4


# --- Grain's index_shuffle, vectorised ------------------------------------------------------

def _seed_seq(seed: int, n: int) -> list[int]:
    """`std::seed_seq{seed}.generate(n words)` (C++11 [rand.util.seedseq]) in pure Python."""
    v = [seed & _U32]
    s = len(v)
    b = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)
    for k in range(m):
        x = b[k % n] ^ b[(k + p) % n] ^ b[(k - 1) % n]
        r1 = (1664525 * (x ^ (x >> 27))) & _U32
        r2 = (r1 + (s if k == 0 else (k % n + v[k - 1] if k <= s else k % n))) & _U32
        b[(k + p) % n] = (b[(k + p) % n] + r1) & _U32
        b[(k + q) % n] = (b[(k + q) % n] + r2) & _U32
        b[k % n] = r2
    for k in range(m, m + n):
        x = (b[k % n] + b[(k + p) % n] + b[(k - 1) % n]) & _U32
        r3 = (1566083941 * (x ^ (x >> 27))) & _U32
        r4 = (r3 - k % n) & _U32
        b[(k + p) % n] ^= r3
        b[(k + q) % n] ^= r4
        b[k % n] = r4
    return b


def _block_bits(max_index: int) -> int:
    """Grain's cipher block size: ceil(log2(max_index)) (in double precision), even, >= 16."""
    bits = math.ceil(math.log2(float(max_index)))
    return max(bits + bits % 2, 16)


def _simon(x: np.ndarray, keys: Sequence[np.ndarray], w: int) -> np.ndarray:
    """Grain's Simon-style Feistel rounds on 2w-bit blocks; one key (scalar or array) per round."""
    mask = np.uint64((1 << w) - 1)
    uw = np.uint64(w)
    s1, s2, s8 = np.uint64(1), np.uint64(2), np.uint64(8)
    r1, r2, r8 = np.uint64(w - 1), np.uint64(w - 2), np.uint64(w - 8)

    def f(v: np.ndarray) -> np.ndarray:
        a = ((v << s1) | (v >> r1)) & mask
        b = ((v << s8) | (v >> r8)) & mask
        c = ((v << s2) | (v >> r2)) & mask
        return (a & b) ^ c

    left, right = (x >> uw) & mask, x & mask
    for i in range(0, len(keys), 2):
        left = left ^ f(right) ^ (keys[i] & mask)
        right = right ^ f(left) ^ (keys[i + 1] & mask)
    return (left << uw) | right


_SMALL = 1 << 16  # below this Grain's 16-bit minimum block makes cycle-walks long


@functools.lru_cache(maxsize=32)
def _small_permutation(seed: int, max_index: int) -> np.ndarray:
    """The whole permutation of [0, max_index] for a small `max_index` (< 2**16).

    With Grain's 16-bit minimum block a value can walk hundreds of cipher passes before landing
    in a small range, so walking index by index is slow. Instead encrypt the whole block once
    (`nxt`), make every in-range value absorbing (`hop`), and square `hop` until each walk has
    landed: the walk from i is nxt[i] followed by hops. Cost: a few gathers over 64 Ki entries,
    ~log2(longest walk) of them; the result (<= 256 KiB) is cached per (seed, size).
    """
    keys = [np.uint64(k) for k in _seed_seq(seed, _ROUNDS)]
    w = _block_bits(max_index) // 2
    nxt = _simon(np.arange(1 << (2 * w), dtype=np.uint64), keys, w).astype(np.int32)
    hop = nxt.copy()
    hop[: max_index + 1] = np.arange(max_index + 1, dtype=np.int32)
    out = nxt[: max_index + 1]
    for _ in range(2 * w + 1):  # 2**(2w+1) hops exceed any walk of the 2**(2w) block
        out = hop[out]
        if out.max() <= max_index:
            break
        hop = hop[hop]
    return out


def index_shuffle(index: np.ndarray | Sequence[int] | int, max_index: int,
                  seed: np.ndarray | Sequence[int] | int) -> np.ndarray:
    """Grain's `index_shuffle(index, max_index, seed, rounds=4)` for arrays of indices.

    `seed` is a scalar or one 32-bit seed per index (e.g. `(shuffle_seed + epoch) % 2**32`).
    Round keys come from `std::seed_seq` once per distinct seed, then the cipher runs on whole
    arrays; cycle-walking re-encrypts only the values that land past `max_index`. Returns int64.
    Equal to Grain's binding value for value (tests compare them) — including Grain's quirk that
    for `max_index == 2**k` (k >= 16, e.g. 65,537 records) the block is one bit too narrow, so
    indices 0 and `max_index` map to the same record and one record is skipped that epoch.
    """
    idx = np.atleast_1d(np.asarray(index, dtype=np.int64))
    max_index = int(max_index)
    if not 0 <= max_index < (1 << 63):
        raise ValueError(f"index_shuffle: max_index must be in [0, 2**63), got {max_index}")
    if idx.size and (idx.min() < 0 or idx.max() > max_index):
        raise ValueError(f"index_shuffle: indices must lie in [0, {max_index}]")
    if max_index == 0:
        return np.zeros(idx.shape, np.int64)
    seeds = np.broadcast_to(np.asarray(seed, dtype=np.int64), idx.shape).reshape(-1)
    uniq, inverse = np.unique(seeds, return_inverse=True)
    if max_index < _SMALL:
        out = np.empty(seeds.shape, np.int64)
        flat = idx.reshape(-1)
        for u, s in enumerate(uniq):
            rows = np.flatnonzero(inverse == u) if len(uniq) > 1 else slice(None)
            out[rows] = _small_permutation(int(s), max_index)[flat[rows]]
        return out.reshape(idx.shape)
    flat = idx.reshape(-1).astype(np.uint64)
    table = np.array([_seed_seq(int(s), _ROUNDS) for s in uniq], dtype=np.uint64)
    keys: list[np.ndarray] = ([table[0, r] for r in range(_ROUNDS)] if len(uniq) == 1
                              else [table[inverse, r] for r in range(_ROUNDS)])
    w = _block_bits(max_index) // 2
    out = _simon(flat, keys, w)
    limit = np.uint64(max_index)
    todo = np.flatnonzero(out > limit)
    while todo.size:
        sub = [k if k.ndim == 0 else k[todo] for k in keys]
        walked = _simon(out[todo], sub, w)
        out[todo] = walked
        todo = todo[walked > limit]
    return out.astype(np.int64).reshape(idx.shape)


# --- record references that carry Grain indices -----------------------------------------------

@dataclass(frozen=True, eq=False)
class IndexedRefs(Refs):
    """Record references plus, per tag, the Grain index each row had at a point of the pipeline.

    `MapWithIndex` and Grain-exact `RandomMap` need the element's index at their own depth of
    the Grain pipeline; a `GrainIndex` node records it under a tag while the plan resolves
    positions, and it rides along with the references through filters (`take`).
    """

    index: dict[int, np.ndarray] = field(default_factory=dict)

    def take(self, idx: np.ndarray | slice) -> "IndexedRefs":
        return IndexedRefs(self.source[idx], self.record[idx], self.epoch[idx],
                           {k: v[idx] for k, v in self.index.items()})

    @staticmethod
    def tagged(refs: Refs, tag: int, values: np.ndarray) -> "IndexedRefs":
        known = dict(refs.index) if isinstance(refs, IndexedRefs) else {}
        known[int(tag)] = values
        return IndexedRefs(refs.source, refs.record, refs.epoch, known)


def _grain_index(pos: np.ndarray, epoch: np.ndarray, length: int | None) -> np.ndarray:
    return pos if length is None else epoch * length + pos


def _split(index: np.ndarray, length: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Grain index -> Zephon (position, epoch) for a child of `length` (None: infinite)."""
    if length is None:
        return index, np.zeros_like(index)
    epoch, pos = np.divmod(index, length)
    return pos, epoch


def _grain_len(node: Node) -> int:
    n = node.length
    return GRAIN_INFINITE if n is None else n


@dataclass(frozen=True)
class GrainIndex(PassThrough):
    """Transparent node that records each row's Grain index at this depth under `tag`."""

    child: Node
    tag: int

    def _resolve(self, pos: np.ndarray, epoch: np.ndarray) -> Refs:
        refs = self.child._resolve(pos, epoch)
        return IndexedRefs.tagged(refs, self.tag, _grain_index(pos, epoch, self.child.length))


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
        src = np.empty_like(pos)
        rec = np.empty_like(pos)
        ep = np.empty_like(pos)
        tags: dict[int, np.ndarray] = {}
        for i, c in enumerate(self.children):
            m = np.flatnonzero(which == i)
            if not m.size:
                continue
            r = c._resolve(*_split(key[m], c.length))
            src[m], rec[m], ep[m] = r.source, r.record, r.epoch
            for tag, values in (r.index.items() if isinstance(r, IndexedRefs) else ()):
                tags.setdefault(tag, np.full(pos.shape, -1, np.int64))[m] = values
        return IndexedRefs(src, rec, ep, tags) if tags else Refs(src, rec, ep)


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
    shuffle: bool = False
    seed: int | None = None
    num_epochs: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_records", "shard_count"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise PlanError(f"GrainSampler.{name} must be a positive integer, got {v!r}")
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
        for name in ("shards", "batch", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise PlanError(f"GrainLoaderOrder.{name} must be a positive integer, got {v!r}")

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
        for name in ("ways", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise PlanError(f"ContiguousBatches.{name} must be a positive integer, got {v!r}")

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

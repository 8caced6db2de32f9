"""Grain's `index_shuffle`, vectorised: the permutation behind Grain's shuffles and samplers.

Grain's `MapDataset.shuffle` and `IndexSampler` map an index through `index_shuffle` (a 4-round
Simon block cipher with cycle-walking, re-keyed per epoch with `seed + epoch`). Grain's own
binding takes one scalar per call (~25 us each here); this module computes it for whole numpy
arrays, value for value (`tests/test_compat_grain_order.py` compares it with Grain's compiled
one), so the plan nodes of `order` name Grain's records at O(len(positions)) cost.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

_U32 = 0xFFFFFFFF
_ROUNDS = 4  # Grain always calls index_shuffle with rounds=4

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


def _simon(x: np.ndarray, keys: Sequence[np.ndarray | np.uint64], w: int) -> np.ndarray:
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

"""Keyed bijections on [0, n): the shuffle of the index algebra.

A shuffle must be random access (position -> record in O(1)), use O(1) memory in `n`, and give
the same answer on every platform and in every process. A balanced Feistel network over the
smallest even number of bits that covers `n`, with cycle-walking back into [0, n), is all three:
pure 64-bit integer arithmetic (numpy wraps modulo 2**64 identically everywhere), a bijection by
construction, and vectorised over arrays of positions. Each key (seed, epoch) gives an
independent permutation, so every epoch is reshuffled without storing anything.

Terms (docs/glossary.md): epoch.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: npt.ArrayLike) -> np.ndarray:
    """The splitmix64 finaliser: a fast, well-mixed 64-bit hash, vectorised (uint64 in/out)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def derive_key(seed: int, epoch: np.ndarray | int) -> np.ndarray:
    """Per-(seed, epoch) 64-bit keys; `epoch` may be an array (one key per position)."""
    s = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
    return splitmix64(s ^ splitmix64(np.asarray(epoch, dtype=np.int64).astype(np.uint64)))


def _half_bits(n: int) -> int:
    return max(1, ((int(n) - 1).bit_length() + 1) // 2)


def _feistel(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    h = np.uint64(half)
    left, right = x >> h, x & mask
    with np.errstate(over="ignore"):
        for r in range(_ROUNDS):
            round_key = splitmix64(keys + np.uint64(r) * _GOLDEN)
            left, right = right, left ^ (splitmix64(right ^ round_key) & mask)
    return (left << h) | right


def permute(index: np.ndarray, n: int, seed: int, epoch: np.ndarray | int = 0) -> np.ndarray:
    """Maps positions `index` (each in [0, n)) through the permutation keyed by (seed, epoch).

    `epoch` is a scalar or an array broadcastable to `index`, so positions from different epochs
    are permuted in one call. Returns int64 values in [0, n).
    """
    n = int(n)
    if n <= 0:
        raise ValueError(f"permute: n must be positive, got {n}")
    idx = np.asarray(index, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"permute: positions must lie in [0, {n})")
    if n == 1:
        return np.zeros_like(idx)
    half = _half_bits(n)
    keys = np.broadcast_to(derive_key(seed, epoch), idx.shape).astype(np.uint64)
    out = _feistel(idx.astype(np.uint64), keys, half)
    # Cycle-walk: re-apply until inside [0, n). The domain is < 4n, so ~<4 passes on average.
    todo = np.flatnonzero(out >= np.uint64(n))
    while todo.size:
        out[todo] = _feistel(out[todo], keys[todo], half)
        todo = todo[out[todo] >= np.uint64(n)]
    return out.astype(np.int64)

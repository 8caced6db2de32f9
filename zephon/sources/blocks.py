"""Whole-block reads for a block-shuffled plan (`zephon.plan.blockshuffle`): a bounded cache of blocks.

Under a block shuffle, the rows of a window come from `window` blocks of `block` consecutive
records, each used by many reads spread over the window's steps. A source that follows the
blocks (the `Loader` calls `follow_blocks(block, capacity)` on it) fetches every block it
touches whole — for an object, one ranged GET per block and shard (contiguous chunks merge) —
keeps it decoded here, and serves the block's other rows from memory. The cache holds at most
`capacity` blocks (the blocks of about two windows that the process's lanes need), evicting the
least recently used: memory is bounded by `capacity × block × record size`, and `stats()`
reports what it holds and held at most.

Threads reading at once may both miss one block and fetch it twice (counted in `stats()`);
worker processes each keep their own cache, so on object storage a block shuffle reads best
inline or with `threads(n)`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

#: The natural block of a format without a unit of its own: consecutive records of about this
#: many bytes on disk, so one ranged GET's round trip is paid for by enough bytes.
BLOCK_TARGET_BYTES = 256 << 10


@dataclass
class BlockStats:
    """What a block cache did: blocks fetched, reads served from memory, memory held."""

    block: int
    capacity: int
    fetched: int = 0
    hits: int = 0
    held_bytes: int = 0
    peak_bytes: int = 0
    held_blocks: int = 0


class BlockCache:
    """Decoded blocks by block number, least recently used evicted beyond `capacity`."""

    def __init__(self, block: int, capacity: int) -> None:
        self.block = int(block)
        self.capacity = max(1, int(capacity))
        self._blocks: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = BlockStats(self.block, self.capacity)

    def stats(self) -> BlockStats:
        with self._lock:
            return BlockStats(**vars(self._stats))

    def gather(self, idx: np.ndarray, fetch: Callable[[list[int]], list[tuple[np.ndarray, int]]]) -> np.ndarray:
        """The records at `idx` (an object array in `idx` order): the blocks they fall in are
        looked up, the missing ones fetched with `fetch(blocks) -> [(records, nbytes), ...]`."""
        b = self.block
        blocks, inv = np.unique(idx // b, return_inverse=True)
        found: dict[int, np.ndarray] = {}
        with self._lock:
            for k in blocks.tolist():
                got = self._blocks.get(k)
                if got is not None:
                    self._blocks.move_to_end(k)
                    found[k] = got[0]
            self._stats.hits += len(found)
        missing = [k for k in blocks.tolist() if k not in found]
        if missing:
            fresh = fetch(missing)
            with self._lock:
                for k, (recs, nbytes) in zip(missing, fresh):
                    found[k] = recs
                    old = self._blocks.pop(k, None)
                    if old is not None:
                        self._stats.held_bytes -= old[1]
                    self._blocks[k] = (recs, nbytes)
                    self._stats.held_bytes += nbytes
                self._stats.fetched += len(missing)
                self._stats.peak_bytes = max(self._stats.peak_bytes, self._stats.held_bytes)
                while len(self._blocks) > self.capacity:
                    _, (_, nbytes) = self._blocks.popitem(last=False)
                    self._stats.held_bytes -= nbytes
                self._stats.held_blocks = len(self._blocks)
        parts = [found[k] for k in blocks.tolist()]
        starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        every = np.empty(int(starts[-1]), dtype=object)
        for p, s in zip(parts, starts[:-1].tolist()):
            every[s:s + len(p)] = p
        return every[starts[inv] + (idx - blocks[inv] * b)]


def natural_block(total_bytes: int, records: int, unit: int = 1) -> int:
    """Records of about `BLOCK_TARGET_BYTES` on disk, a multiple of `unit` (e.g. records per
    chunk), at least one unit."""
    per_record = max(1.0, total_bytes / max(1, records))
    b = max(1, round(BLOCK_TARGET_BYTES / per_record))
    return max(unit, -(-b // unit) * unit)

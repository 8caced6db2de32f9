"""Real Grain as one more column of the verify matrix.

`grain_fingerprints` digests the batches of a real Grain pipeline exactly as `zephon.fingerprints`
digests Zephon's, and `concat_shards` joins a sharded `grain.DataLoader`'s per-shard batches
into global batches, so Grain and its Zephon twin can be compared by fingerprint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from zephon.fingerprints import global_fingerprint

from .records import grain_batch_columns, unflatten_columns


def grain_fingerprints(batches: Iterable[Any], steps: int, lanes: int = 1) -> list[str]:
    """Step fingerprints of the first `steps` batches of a real Grain pipeline.

    Each Grain batch is taken as a global batch split into `lanes` equal lane blocks and digested
    exactly like `zephon.fingerprints.global_fingerprint` (bytes/str columns compared as exact
    values), so the list equals `Dataset.fingerprints(steps)` of the Zephon twin built with the
    same lane count when the data is the same. For a sharded `grain.DataLoader`, pass the
    shards' batches concatenated (`concat_shards`).
    """
    out = []
    it = iter(batches)
    for _ in range(steps):
        out.append(global_fingerprint(grain_batch_columns(next(it)), lanes))
    return out


def concat_shards(loaders: Sequence[Iterable[Any]]) -> Iterator[Any]:
    """Global batches from the per-shard batches of several Grain loaders (shard order)."""
    its = [iter(l) for l in loaders]
    while True:
        try:
            parts = [grain_batch_columns(next(i)) for i in its]
        except StopIteration:
            return
        yield unflatten_columns({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})

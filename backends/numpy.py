"""The reference emitter: a dict of numpy arrays, with the global batch shape known.

Every other backend must produce bit-identical values to this one; tests compare against it.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from zephon.exec.loader import Loader, LocalBatch


def emit(batch: LocalBatch) -> dict[str, np.ndarray]:
    """This process's rows of the global batch, as contiguous numpy arrays."""
    return {k: np.ascontiguousarray(v) for k, v in batch.data.items()}


def global_shapes(batch: LocalBatch) -> dict[str, tuple[int, ...]]:
    """Shape of every field of the whole global batch (all ranks together)."""
    return {k: batch.global_shape(k) for k in batch.data}


def iterate(loader: Loader) -> Iterator[dict[str, np.ndarray]]:
    """Numpy batches from a loader, continuing from its current step."""
    for batch in loader:
        yield emit(batch)

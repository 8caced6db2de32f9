"""The contract every record source fulfils.

A source is random access and *vectorised*: the loader asks for all the records of a batch (or of
several batches) in one `read` call, so a source can use its backend's bulk read (ArrayRecord's
parallel `read(indices)`, a Parquet row group, one `np.take`). Records come back *columnar*: a dict
of arrays whose leading dimension is `len(indices)`, so batching is a no-op and transforms can be
vectorised. Variable-length values (raw bytes, strings, ragged token lists) are object arrays.

Terms (docs/glossary.md): source, record.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

Columns = dict[str, np.ndarray]


@runtime_checkable
class RecordSource(Protocol):
    """Random-access, vectorised record source."""

    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray) -> Columns:
        """Returns the records at `indices` (int64, any order, repeats allowed) as columns."""
        ...


def as_indices(indices: np.ndarray | list[int], n: int, what: str) -> np.ndarray:
    """Validates record indices against a source of `n` records; names the source on error."""
    idx = np.asarray(indices)
    if idx.size and idx.dtype.kind not in "iu":
        raise ValueError(f"{what}: record indices must be integers, got {idx.dtype} "
                         f"({idx.ravel()[:3].tolist()}...)")
    idx = idx.astype(np.int64, copy=False)
    if idx.ndim != 1:
        raise ValueError(f"{what}: indices must be 1-D, got shape {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = int(idx[(idx < 0) | (idx >= n)][0])
        raise IndexError(f"{what}: record {bad} is out of range [0, {n}); the plan's Source size "
                         f"must match the source's length ({n}).")
    return idx

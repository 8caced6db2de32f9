"""The reference emitter: a dict of numpy arrays, with the global batch shape known.

Every other backend must produce bit-identical values to this one; tests compare against it.

Micro-batches (gradient accumulation) are views of a batch: `emit(batch).micro_batches(n)` cuts
this process's rows into `n` equal, consecutive blocks, so concatenating them gives the batch
back exactly, and changing `n` — also at a resume — changes nothing that is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.batch import check_micro_count
from zephon.exec.loader import Loader, LocalBatch


class NumpyBatch(dict):
    """`{field: np.ndarray}` of this process's rows, with `micro_batches(n)`."""

    def micro_batches(self, n: int) -> list[NumpyBatch]:
        """`n` equal, consecutive blocks of the rows (views, no copy); see `micro_batches`."""
        return micro_batches(self, n)


def emit(batch: LocalBatch) -> NumpyBatch:
    """This process's rows of the global batch, as contiguous numpy arrays."""
    return NumpyBatch({k: np.ascontiguousarray(v) for k, v in batch.data.items()})


def global_shapes(batch: LocalBatch) -> dict[str, tuple[int, ...]]:
    """Shape of every field of the whole global batch (all ranks together)."""
    return {k: batch.global_shape(k) for k in batch.data}


def iterate(loader: Loader) -> Iterator[NumpyBatch]:
    """Numpy batches from a loader, continuing from its current step."""
    for batch in loader:
        yield emit(batch)


def _rows(tree: Any) -> set[int]:
    if isinstance(tree, Mapping):
        return set().union(*(_rows(v) for v in tree.values())) if tree else set()
    return {len(tree)}


def _cut(tree: Any, start: int, stop: int) -> Any:
    if isinstance(tree, Mapping):
        return {k: _cut(v, start, stop) for k, v in tree.items()}
    return tree[start:stop]


def micro_batches(batch: LocalBatch | Mapping[str, Any], n: int) -> list[NumpyBatch]:
    """`n` micro-batches of a batch: equal, consecutive blocks of its rows (views).

    `batch` is a `LocalBatch`, an emitted dict, or a nested mapping of arrays (e.g. a Grain-shaped
    batch from `zephon.compat.grain`). Micro-batch `i` holds rows `[i*R/n, (i+1)*R/n)` of this
    process's `R` rows, so `np.concatenate` of the micro-batches, field by field, is the batch,
    whatever `n` — gradient accumulation over them sees exactly the data of the global step.
    """
    tree = batch.data if isinstance(batch, LocalBatch) else batch
    if not isinstance(tree, Mapping):
        raise PlanError(f"micro_batches needs a LocalBatch or a mapping of arrays, got "
                        f"{type(batch).__name__}")
    rows = _rows(tree)
    if len(rows) > 1:
        raise PlanError(f"the batch's fields have different row counts {sorted(rows)}; micro-batches "
                        "cut every field at the same rows.")
    total = rows.pop() if rows else 0
    n = check_micro_count(n, total)
    m = total // n
    return [NumpyBatch(_cut(tree, i * m, (i + 1) * m)) for i in range(n)]

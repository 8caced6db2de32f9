"""In-memory numpy arrays as a source: the reference for tests, demos and small datasets."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Columns, as_indices


class ArraySource:
    """Rows of equal-length arrays; a bare array becomes the single field "data".

    Arrays are kept by reference (no copy at construction); `read` returns fresh copies, so a
    transform may write into what it gets.
    """

    def __init__(self, data: np.ndarray | Mapping[str, np.ndarray]) -> None:
        fields = dict(data) if isinstance(data, Mapping) else {"data": data}
        if not fields:
            raise ValueError("ArraySource needs at least one field")
        self.fields: dict[str, np.ndarray] = {k: np.asarray(v) for k, v in fields.items()}
        scalars = [k for k, v in self.fields.items() if v.ndim == 0]
        if scalars:
            raise ValueError(f"ArraySource: fields {scalars} are 0-d; every field needs a leading "
                             "record dimension.")
        lengths = {k: len(v) for k, v in self.fields.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"ArraySource: fields have different lengths {lengths}; every field "
                             "must have one row per record. Trim or pad them to one length.")
        self._len = next(iter(lengths.values()))
        self._what = repr(self)  # as_indices names the source; repr is too slow per read

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        shapes = {k: (str(v.dtype), v.shape) for k, v in self.fields.items()}
        return f"ArraySource({shapes})"

    def read(self, indices: np.ndarray) -> Columns:
        idx = as_indices(indices, self._len, self._what)
        return {k: np.take(v, idx, axis=0) for k, v in self.fields.items()}

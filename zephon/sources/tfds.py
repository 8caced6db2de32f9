"""A prepared TFDS dataset (ArrayRecord file format) as a source.

TFDS decodes records with numpy alone when TensorFlow is absent, through `tfds.data_source`;
that is all this wraps. Records arrive as (possibly nested) dicts and are stacked into columns
with nested keys joined by "/".
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import DecodeError, SourceError
from ..storage.url import is_remote, local_path
from .base import Columns, as_indices
from .columns import flatten, to_columns
from .tfds_remote import RemoteTFDS


class TFDSSource:
    """One split of a TFDS dataset, given by registered name or by a builder instance.

    `download` defaults to False: a training job should fail fast on a dataset that was not
    prepared, not start a download (these machines have no dataset hub).
    """

    def __init__(self, name_or_builder: Any, split: str,
                 data_dir: str | os.PathLike[str] | None = None, *,
                 decoders: Any = None, download: bool = False) -> None:
        import tensorflow_datasets as tfds

        self.split = split
        from_name = isinstance(name_or_builder, str)
        if from_name:
            self.name: str = name_or_builder
            self.data_dir = local_path(data_dir) if data_dir is not None else None
        elif data_dir is not None:
            raise ValueError("TFDSSource: data_dir applies to a dataset name; a builder already "
                             "knows its data_dir (pass it to the builder instead).")
        else:
            self.name, self.data_dir = name_or_builder.info.full_name, str(name_or_builder.data_dir)
        try:
            if from_name and self.data_dir is not None and is_remote(self.data_dir):
                self._ds = RemoteTFDS(name_or_builder, split, self.data_dir, decoders)
            elif from_name:
                self._ds = tfds.data_source(name_or_builder, split=split, data_dir=self.data_dir,
                                            download=download, decoders=decoders)
            else:
                self._ds = name_or_builder.as_data_source(split=split, decoders=decoders)
        except Exception as e:  # TFDS raises ValueError, AssertionError, NotImplementedError, ...
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise SourceError(
                f"TFDS dataset {self.name!r} split {split!r} (data_dir={self.data_dir!r}) cannot "
                f"be opened: {first_line}. Prepare it first with "
                "builder.download_and_prepare(file_format='array_record'); random access needs "
                "the array_record file format.") from e
        # Fields with a None dimension vary per record: always objects, never value-dependent.
        info = flatten(self._ds.dataset_info.features.get_tensor_info())
        self._ragged = frozenset(k for k, t in info.items() if None in t.shape)
        self._what = repr(self)  # as_indices names the source; repr is too slow per read

    def __len__(self) -> int:
        return len(self._ds)

    def __repr__(self) -> str:
        return f"TFDSSource({self.name!r}, split={self.split!r}, data_dir={self.data_dir!r})"

    def _where(self, record: int) -> str:
        where = f"TFDS {self.name!r} split {self.split!r} (data_dir={self.data_dir!r})"
        return f"{where}: record {record}"

    def _first_failing(self, keys: list[int]) -> int:
        """Pins a failed batch read on one record, so the error names it (error path only)."""
        for key in keys:
            try:
                self._ds[key]
            except Exception:
                return key
        return keys[0]

    def read(self, indices: np.ndarray) -> Columns:
        idx = as_indices(indices, len(self), self._what)
        keys = idx.tolist()
        try:
            rows = self._ds.__getitems__(keys)
        except Exception as e:  # TFDS/array_record report damaged files as RuntimeError etc.
            raise SourceError(f"{self._where(self._first_failing(keys))}: reading failed: {e}. "
                              "Re-prepare the dataset if its files are damaged.") from e
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DecodeError(f"{self._where(keys[i])}: TFDS returned {type(row).__name__}, "
                                  "expected a dict of features; use a FeaturesDict.")
        return to_columns(rows, lambda i: self._where(keys[i]), self._ragged)

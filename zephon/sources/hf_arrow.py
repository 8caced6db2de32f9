"""Hugging Face `datasets` directories written by `Dataset.save_to_disk` as a random-access source.

`save_to_disk` writes Arrow IPC *stream* files (`data-00000-of-0000N.arrow`) and a `state.json`
naming them in order. A stream file has no footer to seek by, but memory-mapping it and reading
the record batches costs only their metadata: the column buffers stay in the page cache, and a
read takes its rows with Arrow's `take`. (`datasets` itself is not needed to read.) Remote
directories (`s3://`, `gs://`) are read whole through the storage layer, once per process.

Columns follow ParquetSource's rules: an `Image()` feature is a struct `{bytes, path}`, so it
arrives as the columns `image/bytes` (object array of encoded bytes, for
`zephon.media.DecodeImage(field="image/bytes")`) and `image/path`; a `ClassLabel` is int64.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import SourceError
from ..storage import open_blob
from ..storage.url import is_remote
from .base import Columns, as_indices
from .parquet import convert_array

__all__ = ["HFArrowSource"]


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}" if is_remote(root) else os.path.join(root, name)


def _read_text(path: str) -> str:
    if is_remote(path):
        return open_blob(path).read_all().decode("utf-8")
    with open(path, encoding="utf-8") as f:
        return f.read()


class HFArrowSource:
    """The rows of a `save_to_disk` directory (one split), in file order.

    columns: the columns to read (default: all); an unknown one is refused naming the others.
    """

    def __init__(self, directory: str | os.PathLike[str], columns: Sequence[str] | None = None) -> None:
        self.directory = os.fspath(directory)
        try:
            state = json.loads(_read_text(_join(self.directory, "state.json")))
        except (OSError, FileNotFoundError) as e:
            hint = ""
            try:
                if json.loads(_read_text(_join(self.directory, "dataset_dict.json"))).get("splits"):
                    hint = " It is a DatasetDict: pass one split's directory (e.g. .../train)."
            except (OSError, ValueError):
                pass
            raise SourceError(f"HFArrowSource: {self.directory!r} has no readable state.json, so it is "
                              f"not a directory written by Dataset.save_to_disk ({e}).{hint}") from None
        files = [f["filename"] for f in state.get("_data_files", [])]
        if not files:
            raise SourceError(f"HFArrowSource: {self.directory}/state.json lists no data files")
        self.files = [_join(self.directory, f) for f in files]
        self.columns = list(columns) if columns is not None else None
        self._table: Any = None
        table = self._open()
        self._len = table.num_rows
        self.schema = table.schema

    def _open(self) -> Any:
        if self._table is None:
            import pyarrow as pa

            tables = []
            for path in self.files:
                try:
                    if is_remote(path):
                        reader = pa.ipc.open_stream(pa.BufferReader(open_blob(path).read_all()))
                    else:
                        reader = pa.ipc.open_stream(pa.memory_map(path, "r"))
                    tables.append(reader.read_all())
                except (OSError, pa.ArrowInvalid) as e:
                    raise SourceError(f"HFArrowSource: {path} is not an Arrow stream file written by "
                                      f"save_to_disk ({e})") from e
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            if self.columns is not None:
                unknown = sorted(set(self.columns) - set(table.column_names))
                if unknown:
                    raise SourceError(f"HFArrowSource: no columns {unknown} in {self.directory} (it "
                                      f"has {table.column_names})")
                table = table.select(self.columns)
            self._table = table
        return self._table

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}   # workers map the files themselves

    def __len__(self) -> int:
        return int(self._len)

    def __repr__(self) -> str:
        return f"HFArrowSource({self.directory!r}, {len(self)} rows)"

    def read(self, indices: np.ndarray) -> Columns:
        import pyarrow as pa

        idx = as_indices(indices, len(self), repr(self))
        rows = self._open().take(pa.array(idx))
        out: Columns = {}

        def locate(i: int) -> str:
            return f"{self.directory}: row {int(idx[i])}"

        for name, column in zip(rows.column_names, rows.columns):
            convert_array(name, column.combine_chunks(), None, locate, out)
        return out

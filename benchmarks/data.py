"""The benchmark data set: the same records as ArrayRecord shards and as Parquet files.

Record `i` is `width` int32 tokens that are a pure function of `i` (column 0 is `i` itself), so any
batch from any loader can be checked against `record_tokens(ids)` without a stored copy, and a
synthetic source can serve a 10**9-record plan with the same content rule.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

VOCAB = 50_000
FORMAT_VERSION = 1


def record_tokens(ids: np.ndarray, width: int) -> np.ndarray:
    """Tokens of records `ids`: column 0 is the id, the rest a splitmix64 hash below VOCAB."""
    ids = np.asarray(ids, dtype=np.int64)
    x = (ids[:, None].astype(np.uint64) << np.uint64(16)) + np.arange(width, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    out = (x % np.uint64(VOCAB)).astype(np.int32)
    out[:, 0] = ids.astype(np.int32)
    return out


@dataclass(frozen=True)
class DataSet:
    """Where the files are and what they hold."""

    root: str
    records: int
    width: int
    shards: int
    writer_options: str
    parquet_files: int
    row_group: int

    @property
    def array_record_paths(self) -> list[str]:
        return [os.path.join(self.root, f"tokens.array_record-{i:05d}-of-{self.shards:05d}")
                for i in range(self.shards)]

    @property
    def parquet_paths(self) -> list[str]:
        return [os.path.join(self.root, f"tokens-{i:05d}-of-{self.parquet_files:05d}.parquet")
                for i in range(self.parquet_files)]

    def to_json(self) -> dict:
        return asdict(self)


def prepare(data_dir: str | os.PathLike[str], records: int, width: int = 256, shards: int = 4,
            writer_options: str = "group_size:1", parquet_files: int = 4, row_group: int = 1000,
            log=print) -> DataSet:
    """Writes the data set under `data_dir` unless an identical one is already there."""
    key = f"n{records}-w{width}-s{shards}-{writer_options.replace(':', '').replace(',', '_')}" \
          f"-p{parquet_files}-g{row_group}"
    root = Path(data_dir).resolve() / key
    ds = DataSet(str(root), records, width, shards, writer_options, parquet_files, row_group)
    manifest = root / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()).get("dataset") == ds.to_json() \
            and all(os.path.exists(p) for p in ds.array_record_paths + ds.parquet_paths):
        return ds
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _write_array_record(ds)
    _write_parquet(ds)
    manifest.write_text(json.dumps({"dataset": ds.to_json(), "format": FORMAT_VERSION}, indent=1))
    log(f"wrote {records} records x {width} int32 to {root} in {time.perf_counter() - t0:.1f} s")
    return ds


def _bounds(n: int, parts: int) -> np.ndarray:
    return np.arange(parts + 1, dtype=np.int64) * n // parts


def _write_array_record(ds: DataSet) -> None:
    from zephon.sources import write_array_record

    bounds = _bounds(ds.records, ds.shards)
    for path, start, stop in zip(ds.array_record_paths, bounds[:-1], bounds[1:]):
        def records(start=start, stop=stop):
            for a in range(start, stop, 8192):
                block = record_tokens(np.arange(a, min(stop, a + 8192)), ds.width)
                yield from (row.tobytes() for row in block)
        write_array_record(path + ".tmp", records(), ds.writer_options)
        os.replace(path + ".tmp", path)


def _write_parquet(ds: DataSet) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    bounds = _bounds(ds.records, ds.parquet_files)
    for path, start, stop in zip(ds.parquet_paths, bounds[:-1], bounds[1:]):
        tokens = record_tokens(np.arange(start, stop), ds.width)
        column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), ds.width)
        pq.write_table(pa.table({"tokens": column}), path + ".tmp", row_group_size=ds.row_group)
        os.replace(path + ".tmp", path)

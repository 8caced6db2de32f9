"""Grain's iterator-level datasets under their Grain names (`zg.experimental.X`), as `Dataset`s.

`ThreadPrefetchIterDataset`, `device_put`, `WindowShuffleIterDataset`, `FlatMapIterDataset` /
`FlatMapMapDataset`, `InterleaveIterDataset`, `ParquetIterDataset` and `IterDataset.mix` take
Grain's arguments and give Grain's elements; they run after Zephon's plan (`tail`, `streams`),
so what comes before them keeps Zephon's guarantees and they add Grain's own (a JSON iterator
state). `pick_performance_config` picks Zephon runner settings in Grain's option types, and
`mp_prefetch` / `ReadOptions` select the runner (`pipeline.options_runner`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from zephon.errors import PlanError
from zephon.runners.base import available_cores

from .compile import GraphOp
from .dataset import Dataset, iter_mix

FlatMapTransform = grain.experimental.FlatMapTransform


def _as_dataset(ds: Any, who: str) -> Dataset:
    if isinstance(ds, Dataset):
        return ds
    raise PlanError(f"{who} takes a zephon.compat.grain Dataset, got {type(ds).__name__}; build "
                    f"the pipeline with zg.Dataset (a real Grain dataset takes grain.experimental.{who}).")


def ThreadPrefetchIterDataset(parent: Any, *, prefetch_buffer_size: int) -> Dataset:
    """Grain's thread prefetch: a thread reads `prefetch_buffer_size` elements ahead."""
    ds = _as_dataset(parent, "ThreadPrefetchIterDataset")
    return ds._then("prefetch", size=int(prefetch_buffer_size))


@dataclass(frozen=True)
class _DevicePut:
    device: Any

    def __call__(self, x: Any) -> Any:
        import jax
        return jax.device_put(x, self.device)


def device_put(ds: Any, device: Any, *, cpu_buffer_size: int = 4, device_buffer_size: int = 2) -> Dataset:
    """Grain's `experimental.device_put`: host prefetch, `jax.device_put(x, device)` (a device
    or a sharding), device-side prefetch — the same three stages as Grain's."""
    out = ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cpu_buffer_size)
    out = out.map(_DevicePut(device))
    return ThreadPrefetchIterDataset(out, prefetch_buffer_size=device_buffer_size)


def WindowShuffleIterDataset(parent: Any, *, window_size: int, seed: int) -> Dataset:
    """Grain's window shuffle (Grain's permutation of every window of `window_size`)."""
    ds = _as_dataset(parent, "WindowShuffleIterDataset")
    return ds._then("window_shuffle", window_size=int(window_size), seed=int(seed))


def FlatMapIterDataset(parent: Any, transform: Any) -> Dataset:
    """Grain's flat map: each element becomes `transform.flat_map(element)`'s items, in order."""
    ds = _as_dataset(parent, "FlatMapIterDataset")
    return ds._then("flat_map", transform=transform)


def FlatMapMapDataset(parent: Any, transform: Any) -> Dataset:
    """Grain's `FlatMapMapDataset`: `max_fan_out` slots per element, random access (None in the
    unused slots), `len` = max_fan_out * len(parent); iteration skips the Nones."""
    ds = _as_dataset(parent, "FlatMapMapDataset")
    return ds._then("flat_map_map", transform=transform)


def InterleaveIterDataset(datasets: Sequence[Any], *, cycle_length: int, **_: Any) -> Dataset:
    """Grain's interleave: `cycle_length` datasets open, one element of each in turn."""
    dss = [_as_dataset(d, "InterleaveIterDataset") if isinstance(d, Dataset) else d for d in datasets]
    return Dataset(GraphOp("interleave", (), {"datasets": tuple(dss), "cycle_length": int(cycle_length)}))


class IterDataset(Dataset):
    """`grain.IterDataset` spellings (`zg.IterDataset.mix(...)`); any `Dataset` is one."""

    @classmethod
    def mix(cls, datasets: Any, weights: Sequence[float] | None = None, **_: Any) -> Dataset:
        return iter_mix(datasets, weights)


class _ParquetRows(grain.DatasetIterator):
    """Rows of one Parquet file as dicts of numpy values, row group by row group (as Grain)."""

    def __init__(self, path: str, read_kwargs: Mapping[str, Any]) -> None:
        import pyarrow.parquet as pq
        super().__init__()
        self._file = pq.ParquetFile(path, **read_kwargs)
        self._group, self._row, self._cols = 0, 0, self._read(0)

    def _read(self, group: int) -> dict[str, np.ndarray]:
        if self._file.num_row_groups == 0:
            return {}
        t = self._file.read_row_group(group)
        return {t.field(i).name: t.column(i).to_numpy() for i in range(t.num_columns)}

    def __next__(self) -> dict[str, Any]:
        n = len(next(iter(self._cols.values()))) if self._cols else 0
        while self._row >= n:
            if self._group + 1 >= self._file.num_row_groups:
                raise StopIteration
            self._group, self._row = self._group + 1, 0
            self._cols = self._read(self._group)
            n = len(next(iter(self._cols.values()))) if self._cols else 0
        row = {k: v[self._row] for k, v in self._cols.items()}
        self._row += 1
        return row

    def get_state(self) -> dict[str, Any]:
        return {"row_group": self._group, "index_within_row_group": self._row}

    def set_state(self, state: dict[str, Any]) -> None:
        self._group, self._row = int(state["row_group"]), int(state["index_within_row_group"])
        self._cols = self._read(self._group)


def ParquetIterDataset(path: str | Sequence[str], **read_kwargs: Any) -> Dataset:
    """Grain's Parquet iterator: one file's rows, or up to 16 files interleaved (as Grain)."""
    paths = [path] if isinstance(path, (str, bytes, os.PathLike)) else list(path)
    if not paths:
        raise PlanError("ParquetIterDataset needs at least one path")
    files = [Dataset(GraphOp("external", (), {"make": functools.partial(_ParquetRows, p, read_kwargs)}))
             for p in paths]
    return files[0] if len(files) == 1 else InterleaveIterDataset(files, cycle_length=16)


@dataclass(frozen=True)
class PerformanceConfig:
    """What `pick_performance_config` returns (Grain's field names)."""

    multiprocessing_options: Any
    read_options: Any


def pick_performance_config(ds: Any, ram_budget_mb: int, max_workers: int | None = None,
                            max_buffer_size: int | None = None) -> PerformanceConfig:
    """Grain's helper, answered for Zephon: workers = the cores this process may use (at most
    `max_workers`), read threads likewise; Zephon's runners bound memory by their step depth, so
    the RAM budget only caps the buffer."""
    cores = available_cores()
    workers = min(cores, max_workers) if max_workers is not None else cores
    buffer = min(500, max_buffer_size) if max_buffer_size is not None else 500
    buffer = max(1, min(buffer, int(ram_budget_mb)))
    return PerformanceConfig(grain.MultiprocessingOptions(num_workers=workers),
                             grain.ReadOptions(num_threads=max(1, workers), prefetch_buffer_size=buffer))

"""One measurement per fresh process, so no case inherits another's caches, threads or memory.

`run.py` starts `python -c "...; cases.child_main()" '<case json>'`; the child builds the pipeline,
checks the content of its first and last batch against `record_tokens`, and prints one line
`RESULT {json}`. Everything a worker process must unpickle (Grain transforms, the synthetic
source) is defined here, at module level, so spawned workers can import it.

Timing: every loader streams its shuffled epochs endlessly. `first_batch_s` runs from building
the pipeline to the first batch (worker start-up included); `samples_per_s` is the steady rate
over `max_seconds` after a warm-up (10% of an epoch, or 2 s past the first batch);
`overall_samples_per_s` counts everything from construction on.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from data import DataSet, record_tokens

SEED = 0
LANES = 8


# --- shared helpers ---------------------------------------------------------------------------
def consume(make: Callable[[], Iterator[Any]], rows: Callable[[Any], np.ndarray], records: int,
            max_seconds: float, check: Callable[[Any], None]) -> dict[str, Any]:
    """Times an endless stream (every loader repeats its shuffled epochs) for `max_seconds` once
    warmed up: after 10% of an epoch or 2 s past the first batch, whichever comes first, so
    worker start-up and filling prefetch buffers count for no loader, and what a prefetching
    loader banked during warm-up is small against the measured window."""
    t0 = time.perf_counter()
    it = make()
    first = next(it)
    t1 = time.perf_counter()
    check(first)
    done, last = len(rows(first)), first
    t_warm, warm_done = None, 0
    for last in it:
        done += len(rows(last))
        now = time.perf_counter()
        if t_warm is None and (done >= records // 10 or now - t1 >= 2.0):
            t_warm, warm_done = now, done
        elif t_warm is not None and now - t_warm >= max_seconds:
            break
    t2 = time.perf_counter()
    check(last)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return {"first_batch_s": t1 - t0, "samples": done, "seconds": t2 - t0,
            "overall_samples_per_s": done / (t2 - t0), "steady_samples": done - warm_done,
            "steady_seconds": t2 - t_warm, "samples_per_s": (done - warm_done) / (t2 - t_warm)}


def check_rows(tokens: np.ndarray, width: int) -> None:
    """Each row must be exactly the record its first token names."""
    tokens = np.asarray(tokens)
    if tokens.shape[1:] != (width,) or not np.array_equal(tokens, record_tokens(tokens[:, 0], width)):
        raise AssertionError(f"batch content is wrong (shape {tokens.shape})")


def fixed_spec(width: int) -> Any:
    from zephon.sources import FixedFields

    return FixedFields({"tokens": ("int32", (width,))})


# --- Zephon -------------------------------------------------------------------------------------
def zephon_source(ds: DataSet, fmt: str) -> Any:
    from zephon.sources import ArrayRecordSource, ParquetSource

    if fmt == "array_record":
        return ArrayRecordSource(ds.array_record_paths, fixed_spec(ds.width))
    return ParquetSource(ds.parquet_paths, columns=["tokens"])


def case_zephon(ds: DataSet, fmt: str, runner: str, batch: int, max_seconds: float,
                read_ahead: int | None = None) -> dict[str, Any]:
    from zephon import How, Loader, Pipeline, Source
    from zephon.runners import from_spec

    src = zephon_source(ds, fmt)
    plan = Source(len(src)).shuffle(SEED).repeat().lanes(LANES).batch(batch)  # reshuffled epochs

    def check(b: Any) -> None:
        check_rows(b.data["tokens"], ds.width)
        if not np.array_equal(b.data["tokens"][:, 0], plan.refs(b.step).record):
            raise AssertionError(f"step {b.step} does not hold the plan's records")

    def make() -> Iterator[Any]:
        return Loader(Pipeline(plan, src), how=How(runner=from_spec(runner), read_ahead=read_ahead))

    return consume(make, lambda b: b.data["tokens"], ds.records, max_seconds, check)


# --- Grain --------------------------------------------------------------------------------------
def case_grain(ds: DataSet, config: str, batch: int, max_seconds: float, workers: int) -> dict[str, Any]:
    import grain
    from grain_ops import DecodeRecord, decode_batch

    source = grain.sources.ArrayRecordDataSource(ds.array_record_paths)
    base = grain.MapDataset.source(source).shuffle(seed=SEED).repeat()  # reshuffled epochs
    per_record = lambda: base.map(DecodeRecord()).batch(batch, drop_remainder=True)
    batch_first = lambda: base.batch(batch, drop_remainder=True, batch_fn=decode_batch)

    def indexed(ds_: Any) -> Callable[[], Iterator[Any]]:
        return lambda: (ds_[i] for i in itertools.count())

    if config == "map[i]":
        make = indexed(per_record())
    elif config == "map[i] batch-decode":
        make = indexed(batch_first())
    elif config == "iter threads=16":
        make = lambda: iter(base.map(DecodeRecord()).to_iter_dataset(
            grain.ReadOptions(num_threads=16, prefetch_buffer_size=500)).batch(batch, drop_remainder=True))
    elif config == "iter batch-decode threads=4":
        make = lambda: iter(batch_first().to_iter_dataset(
            grain.ReadOptions(num_threads=4, prefetch_buffer_size=16)))
    elif config == f"mp_prefetch workers={workers}":
        make = lambda: iter(batch_first().to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
                            .mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=4)))
    elif config == f"DataLoader workers={workers}":
        sampler = grain.samplers.IndexSampler(len(source), shuffle=True, seed=SEED, num_epochs=None,
                                              shard_options=grain.sharding.NoSharding())
        make = lambda: iter(grain.DataLoader(
            data_source=source, sampler=sampler, worker_count=workers, worker_buffer_size=4,
            operations=[DecodeRecord(), grain.transforms.Batch(batch, drop_remainder=True)]))
    else:
        raise ValueError(f"unknown grain config {config!r}")
    return consume(make, np.asarray, ds.records, max_seconds, lambda b: check_rows(b, ds.width))


# --- raw ceilings -------------------------------------------------------------------------------
def case_raw_array_record(ds: DataSet, batch: int, group: int, max_seconds: float) -> dict[str, Any]:
    """ArrayRecordReader.read of the plan's shuffled indices, `group` records a call per shard
    touched, then the same decode; nothing else (indices are computed before the clock starts)."""
    from array_record.python import array_record_module as ar

    from zephon import Source
    from zephon.exec.steps import steps_refs

    readers = [ar.ArrayRecordReader(p, "readahead_buffer_size:0", file_reader_buffer_size=32768)
               for p in ds.array_record_paths]
    ends = np.cumsum([r.num_records() for r in readers])
    starts = np.concatenate([[0], ends[:-1]])
    plan = Source(int(ends[-1])).shuffle(SEED).lanes(LANES).batch(batch)
    order = steps_refs(plan, 0, plan.num_steps, plan.lanes.owned(0, 1)).record
    spec = fixed_spec(ds.width)

    def read(idx: np.ndarray) -> np.ndarray:
        shard = np.searchsorted(ends, idx, side="right")
        local = idx - starts[shard]
        by_shard = np.argsort(shard, kind="stable")
        cuts = np.flatnonzero(np.diff(shard[by_shard])) + 1
        records = np.empty(len(idx), dtype=object)
        for pos in np.split(by_shard, cuts):
            records[pos] = readers[int(shard[pos[0]])].read(local[pos].tolist())
        return spec.decode(records, str)["tokens"]

    def make() -> Iterator[np.ndarray]:
        return (read(order[a:a + group]) for a in itertools.cycle(range(0, len(order), group)))

    return consume(make, lambda x: x, len(order), max_seconds, lambda x: check_rows(x, ds.width))


def case_raw_parquet(ds: DataSet, max_seconds: float) -> dict[str, Any]:
    """pyarrow reading whole files into numpy: the fastest Parquet gets, no shuffle at all."""
    import pyarrow.parquet as pq

    def make() -> Iterator[np.ndarray]:
        for path in itertools.cycle(ds.parquet_paths):
            column = pq.read_table(path, columns=["tokens"]).column("tokens").combine_chunks()
            yield column.flatten().to_numpy().reshape(len(column), ds.width)

    return consume(make, lambda x: x, ds.records, max_seconds, lambda x: check_rows(x, ds.width))


# --- scaling: plan size and resume ----------------------------------------------------------------
class SyntheticSource:
    """`n` records made on demand by `record_tokens`: a data set of any size, no files."""

    def __init__(self, n: int, width: int) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {"tokens": record_tokens(np.asarray(indices, np.int64), self.width)}


def case_plan_memory(ds: DataSet, size: int, steps: int, batch: int) -> dict[str, Any]:
    """Peak RSS of iterating a shuffled, repeated plan over `size` records (synthetic source)."""
    from zephon import Loader, Pipeline, Source

    plan = Source(size).shuffle(SEED).repeat().lanes(64).batch(batch)
    loader = Loader(Pipeline(plan, SyntheticSource(size, ds.width)))
    t0 = time.perf_counter()
    for _ in range(steps):
        b = next(loader)
    if not np.array_equal(b.data["tokens"][:, 0], plan.refs(b.step).record):
        raise AssertionError("synthetic batch mismatch")
    return {"records": size, "steps": steps, "seconds": time.perf_counter() - t0,
            "samples_per_s": steps * batch / (time.perf_counter() - t0)}


def case_resume(ds: DataSet, batch: int, far: int, trials: int, runner: str) -> dict[str, Any]:
    """Time to the first batch at step 0, at step `far` (start_step) and restoring a state saved
    at `far`: each from a new Loader on an opened source, median of `trials` alternated runs."""
    from zephon import How, Loader, Pipeline, Source
    from zephon.runners import from_spec

    src = zephon_source(ds, "array_record")
    plan = Source(len(src)).shuffle(SEED).repeat().lanes(64).batch(batch)
    pipe = Pipeline(plan, src)
    saved = Loader(pipe, start_step=far).state()

    def first(start: int, restore: bool) -> float:
        t0 = time.perf_counter()
        loader = Loader(pipe, how=How(runner=from_spec(runner)), start_step=0 if restore else start)
        if restore:
            loader.restore(saved)
        b = next(loader)
        dt = time.perf_counter() - t0
        loader.close()
        if b.step != start or not np.array_equal(b.data["tokens"][:, 0], plan.refs(start).record):
            raise AssertionError(f"first batch at step {start} is wrong")
        return dt

    first(0, False)  # opens the readers, warms caches
    t = {"step 0": [], f"start_step={far}": [], f"restore at {far}": []}
    for _ in range(trials):
        t["step 0"].append(first(0, False))
        t[f"start_step={far}"].append(first(far, False))
        t[f"restore at {far}"].append(first(far, True))
    return {k: statistics.median(v) for k, v in t.items()} | {"trials": trials, "runner": runner}


# --- entry --------------------------------------------------------------------------------------
CASES = {"zephon": case_zephon, "grain": case_grain, "raw_array_record": case_raw_array_record,
         "raw_parquet": case_raw_parquet, "plan_memory": case_plan_memory, "resume": case_resume}


def _filter_cases() -> dict[str, Callable[..., dict[str, Any]]]:
    from bench_filter import CASES as filter_cases  # issue 11: filter pipeline vs one-to-one vs Grain

    return filter_cases


CASES.update(_filter_cases())


def child_main() -> None:
    spec = json.loads(sys.argv[1])
    ds = DataSet(**spec.pop("dataset"))
    kind = spec.pop("kind")
    out = CASES[kind](ds, **spec)
    out["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["children_ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    out["pid"] = os.getpid()
    sys.stdout.write("RESULT " + json.dumps(out) + "\n")
    sys.stdout.flush()

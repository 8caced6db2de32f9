"""Loader -> torch tensors, against the numpy backend alone, in one run.

Data: `--records` x 256 int32 tokens, global shuffle, 64 lanes, batches of 64 and 1024, from two
sources in turn: ArrayRecord in 4 shards and in-memory numpy (where the backend's own cost stands
out). Rows, each the median of `--rounds` interleaved rounds (machine noise hits every row alike),
each round reading batches no earlier round read, after one warm batch (start-up not timed). Each
round runs the rows in a new random order, so no row always follows the same one (a DataLoader's
workers shutting down would otherwise slow whichever row comes next), with a pause between rows.

  numpy               Loader + numpy emitter: the reference
  torch               TorchLoader: the same rows as zero-copy tensors
  torch cast int64    TorchLoader(dtypes={"tokens": torch.int64}): one cast (a copy) per batch
  DataLoader w=0      ZephonDataLoader(num_workers=0): torch's DataLoader around the dataset
  DataLoader w=2      ZephonDataLoader(num_workers=2): two DataLoader workers, each computing
                      every other step; torch moves every batch into new shared memory

    python benchmarks/bench_torch.py          # writes benchmarks/results/torch.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from zephon import Loader, Pipeline, Source
from zephon.backends.numpy import emit
from zephon.backends.torch import TorchLoader, ZephonDataLoader, ZephonIterableDataset
from zephon.sources.array_record import ArrayRecordSource, write_sharded_array_record
from zephon.sources.base import RecordSource
from zephon.sources.memory import ArraySource
from zephon.sources.spec import FixedFields

SEQ, LANES = 256, 64
RESULTS = Path(__file__).resolve().parent / "results" / "torch.json"


def write_data(directory: str, tokens: np.ndarray) -> ArrayRecordSource:
    spec = FixedFields({"tokens": ("int32", (SEQ,))})
    write_sharded_array_record(os.path.join(directory, "tokens"), [r.tobytes() for r in tokens], 4)
    return ArrayRecordSource(os.path.join(directory, "tokens@4"), spec)


def timed(batches: Iterator, steps: int) -> float:
    """Seconds per step of taking `steps` batches, after a first warm one."""
    next(batches)
    t = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return (time.perf_counter() - t) / steps


def measure(source: RecordSource, batch: int, args: argparse.Namespace) -> dict:
    plan = Source(len(source)).shuffle(seed=1).repeat().lanes(LANES).batch(batch)
    steps = max(20, args.samples // batch)
    cursor = {"step": 0}

    def fresh_start() -> int:
        start = cursor["step"]
        cursor["step"] += steps + 1
        return start

    def numpy_run() -> float:
        return timed(map(emit, Loader(Pipeline(plan, source), start_step=fresh_start())), steps)

    def torch_run(**options: object) -> Callable[[], float]:
        def run() -> float:
            with TorchLoader(Pipeline(plan, source), start_step=fresh_start(), **options) as loader:
                return timed(loader, steps)
        return run

    def dataloader_run(workers: int) -> Callable[[], float]:
        def run() -> float:
            ds = ZephonIterableDataset(Pipeline(plan, source), start_step=fresh_start())
            it = iter(ZephonDataLoader(ds, num_workers=workers))
            try:
                return timed(it, steps)
            finally:
                del it  # shuts the workers down outside the timing
        return run

    rows: dict[str, Callable[[], float]] = {
        "numpy": numpy_run,
        "torch": torch_run(),
        "torch cast int64": torch_run(dtypes={"tokens": torch.int64}),
        "DataLoader w=0": dataloader_run(0),
        "DataLoader w=2": dataloader_run(2),
    }
    times: dict[str, list[float]] = {k: [] for k in rows}
    order = np.random.default_rng(0)
    for _ in range(args.rounds):
        for name in order.permutation(list(rows)):
            gc.collect()
            time.sleep(0.2)  # let the previous row's processes finish exiting
            times[name].append(rows[name]())
    t = {k: statistics.median(v) for k, v in times.items()}
    return {
        "steps_per_round": steps,
        "ms_per_step": {k: round(v * 1e3, 3) for k, v in t.items()},
        "samples_per_s": {k: round(batch / v) for k, v in t.items()},
        "vs_numpy": {k: round(t["numpy"] / v, 3) for k, v in t.items()},
    }


def report(name: str, batch: int, r: dict) -> None:
    print(f"\n{name}, batch {batch}")
    print(f"{'':20}{'ms/step':>9}{'samples/s':>11}{'vs numpy':>10}")
    for k, ms in r["ms_per_step"].items():
        print(f"{k:20}{ms:>9.3f}{r['samples_per_s'][k]:>11}{r['vs_numpy'][k]:>10.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--samples", type=int, default=65_536, help="samples per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    tokens = (np.arange(args.records * SEQ, dtype=np.int64) % 50_257).astype(np.int32)
    tokens = tokens.reshape(args.records, SEQ)
    results: dict = {}
    load_avg = []  # other work on the machine makes every row noisier
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"array_record": write_data(tmp, tokens), "memory": ArraySource({"tokens": tokens})}
        for name, source in sources.items():
            for batch in args.batches:
                results[f"{name} batch {batch}"] = r = measure(source, batch, args)
                report(name, batch, r)
                load_avg.append(round(os.getloadavg()[0], 2))
    config = {"records": args.records, "seq": SEQ, "lanes": LANES, "batches": args.batches,
              "rounds": args.rounds, "samples_per_round": args.samples, "cpus": os.cpu_count(),
              "load_avg_1min": load_avg, "torch": torch.__version__, "numpy": np.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": config, **results}, indent=2) + "\n")
    print(f"\n{os.cpu_count()} cores, {args.records} records x {SEQ} int32, 64 lanes; "
          f"1-min load average during the runs: {load_avg}; wrote {args.out}")


if __name__ == "__main__":
    main()

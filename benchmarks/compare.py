"""Zephon beside the loaders a team would otherwise pick: Grain, torchdata, Mosaic Streaming, HF datasets.

Two questions, measured on the same records in one run:

1. **Elastic determinism**: with each loader's documented way to shard across D data-parallel
   ranks, is global batch k (the ranks' local batches in rank order) the same at D = 2 and 4 as
   at D = 1? Counted over the first `--steps` global batches, once as the same rows (the batch's
   gradient is a sum over its rows, so this is what training sees) and once in the same order.
2. **Throughput** at D = 1: rows/s of globally shuffled batches of `--batch` rows, one process,
   each loader's plain configuration (no extra worker processes), after one warm-up batch.

Record i is `width` int32 tokens whose column 0 is i, so every row names its record. Each loader
reads its own format of the same records: ArrayRecord (Zephon, Grain, torchdata over Grain's
ArrayRecord source), MDS (Mosaic Streaming), Arrow (HF datasets).

Mosaic Streaming coordinates the ranks of a node through shared memory, so its D ranks run as D
processes at once, each with the RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE environment a
launcher gives; the others build rank r's pipeline in this process, which is what rank r runs.

Run with `make compare` (a separate venv: Streaming, datasets and torchdata pull packages that
would change the project's pinned environment). Writes benchmarks/results/compare.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import record_tokens

SEED = 7
LANES = 64


def write_all(root: Path, records: int, width: int) -> None:
    """The same records as ArrayRecord shards, MDS shards and an Arrow data set."""
    from zephon.sources.array_record import write_sharded_array_record

    rows = record_tokens(np.arange(records), width)
    (root / "ar").mkdir()
    write_sharded_array_record(root / "ar" / "tokens.array_record", (r.tobytes() for r in rows), num_shards=4)

    from streaming import MDSWriter

    with MDSWriter(out=str(root / "mds"), columns={"tokens": f"ndarray:int32:{width}"}, size_limit=1 << 24) as w:
        for r in rows:
            w.write({"tokens": r})

    import datasets

    datasets.Dataset.from_dict({"tokens": rows}).save_to_disk(str(root / "arrow"))


def ar_paths(root: Path) -> list[str]:
    return sorted(str(p) for p in (root / "ar").glob("tokens.array_record-*"))


# --- each loader's rank r of D: an iterator of local batches (arrays of rows) -------------------------
def zephon_rank(root: Path, records: int, width: int, batch: int, r: int, d: int) -> Iterator[np.ndarray]:
    import zephon as z
    from zephon.sources import ArrayRecordSource, FixedFields

    src = ArrayRecordSource(ar_paths(root), FixedFields({"tokens": ("int32", (width,))}))
    plan = z.Source(records).shuffle(seed=SEED).repeat().lanes(LANES).batch(batch)
    return (b.data["tokens"] for b in z.Loader(z.Pipeline(plan, src), z.Where(rank=r, world=d)))


def grain_rank(root: Path, records: int, width: int, batch: int, r: int, d: int) -> Iterator[np.ndarray]:
    import grain

    source = grain.sources.ArrayRecordDataSource(ar_paths(root))
    sampler = grain.samplers.IndexSampler(records, shuffle=True, seed=SEED, num_epochs=None,
                                          shard_options=grain.sharding.ShardOptions(r, d, drop_remainder=True))
    loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=0,
                              operations=[_grain_decode(width),
                                          grain.transforms.Batch(batch // d, drop_remainder=True)])
    return iter(loader)


def grain_dataset_rank(root: Path, records: int, width: int, batch: int, r: int, d: int) -> Iterator[np.ndarray]:
    """Grain's dataset API, its fastest configuration here: shuffle, then rank r's slice `[r::D]`."""
    import grain

    source = grain.sources.ArrayRecordDataSource(ar_paths(root))
    ds = grain.MapDataset.source(source).shuffle(seed=SEED).repeat()[r::d]
    ds = ds.batch(batch // d, drop_remainder=True,
                  batch_fn=lambda bs: np.frombuffer(b"".join(bs), dtype=np.int32).reshape(len(bs), width))
    return (ds[i] for i in range(len(ds)))


def _grain_decode(width: int) -> Any:
    """A `grain.transforms.Map` decoding one record; built here so this module imports without Grain."""
    import grain

    class Decode(grain.transforms.Map):
        def map(self, b: bytes) -> np.ndarray:
            return np.frombuffer(b, dtype=np.int32, count=width)

    return Decode()


def torchdata_rank(root: Path, records: int, width: int, batch: int, r: int, d: int) -> Iterator[np.ndarray]:
    import grain
    from torch.utils.data import DistributedSampler
    from torchdata.nodes import Batcher, Loader, Mapper, SamplerWrapper

    source = grain.sources.ArrayRecordDataSource(ar_paths(root))

    class Records:  # a map-style dataset, as torch users write one
        def __len__(self) -> int:
            return records

        def __getitem__(self, i: int) -> np.ndarray:
            return np.frombuffer(source[i], dtype=np.int32, count=width)

    data = Records()
    sampler = DistributedSampler(data, num_replicas=d, rank=r, shuffle=True, seed=SEED, drop_last=True)
    node = Batcher(Mapper(SamplerWrapper(sampler), data.__getitem__), batch_size=batch // d, drop_last=True)
    return (np.stack(b) for b in Loader(node))


def hf_rank(root: Path, records: int, width: int, batch: int, r: int, d: int) -> Iterator[np.ndarray]:
    import datasets
    from datasets.distributed import split_dataset_by_node

    ds = datasets.load_from_disk(str(root / "arrow")).shuffle(seed=SEED)
    ds = split_dataset_by_node(ds, rank=r, world_size=d).with_format("numpy")
    return (b["tokens"] for b in ds.iter(batch_size=batch // d, drop_last_batch=True))


def _streaming_worker(root: str, batch: int, r: int, d: int, steps: int, out: str, t_out: str, port: int) -> None:
    # what torchrun gives each rank; Streaming starts torch.distributed (gloo) from it at D > 1
    os.environ.update(RANK=str(r), WORLD_SIZE=str(d), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(d),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from streaming import StreamingDataset

    ds = StreamingDataset(local=os.path.join(root, "mds"), shuffle=True, shuffle_seed=SEED,
                          num_canonical_nodes=1, batch_size=batch // d, replication=None)
    it = iter(ds)
    rows = []
    t0 = 0.0
    for k in range(steps + 1):
        if k == 1:
            t0 = time.perf_counter()
        rows.append(np.stack([next(it)["tokens"] for _ in range(batch // d)]))
    elapsed = time.perf_counter() - t0
    np.save(out, np.stack(rows))
    Path(t_out).write_text(str(elapsed))


def streaming_run(root: Path, batch: int, d: int, steps: int) -> tuple[list[np.ndarray], float]:
    """Runs D Streaming ranks as D processes; returns global batches (ranks' rows in rank order)."""
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ctx = mp.get_context("spawn")
    tmp = Path(tempfile.mkdtemp(prefix="zephon-compare-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_streaming_worker,
                         args=(str(root), batch, r, d, steps, str(tmp / f"{r}.npy"), str(tmp / f"{r}.t"), port))
             for r in range(d)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 600
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                raise RuntimeError("a Streaming rank did not finish in 600 s")
            if p.exitcode != 0:
                raise RuntimeError(f"a Streaming rank failed with exit code {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    ranks = [np.load(tmp / f"{r}.npy") for r in range(d)]
    elapsed = max(float((tmp / f"{r}.t").read_text()) for r in range(d))
    shutil.rmtree(tmp)
    clean_stale_shared_memory()
    return [np.concatenate([rk[k] for rk in ranks]) for k in range(steps + 1)], elapsed


IN_PROCESS: dict[str, Callable[..., Iterator[np.ndarray]]] = {
    "Zephon (Loader, rank/world)": zephon_rank,
    "Grain (DataLoader, ShardOptions)": grain_rank,
    "Grain (MapDataset, shuffle then [r::D])": grain_dataset_rank,
    "torchdata.nodes (DistributedSampler)": torchdata_rank,
    "HF datasets (split_dataset_by_node)": hf_rank,
}
STREAMING = "Mosaic Streaming (StreamingDataset, num_canonical_nodes=1)"


def global_batches(name: str, root: Path, records: int, width: int, batch: int, d: int,
                   steps: int) -> list[np.ndarray]:
    if name == STREAMING:
        return streaming_run(root, batch, d, steps)[0][:steps]
    ranks = [IN_PROCESS[name](root, records, width, batch, r, d) for r in range(d)]
    return [np.concatenate([next(it) for it in ranks]) for _ in range(steps)]


def throughput(name: str, root: Path, records: int, width: int, batch: int, steps: int) -> float:
    if name == STREAMING:
        _, elapsed = streaming_run(root, batch, 1, steps)
        return steps * batch / elapsed
    it = IN_PROCESS[name](root, records, width, batch, 0, 1)
    next(it)  # warm-up: opens files, starts threads
    t0 = time.perf_counter()
    for _ in range(steps):
        b = next(it)
        assert b.shape == (batch, width), b.shape
    return steps * batch / (time.perf_counter() - t0)


def check_rows(rows: np.ndarray, width: int) -> None:
    """Every row is the record its column 0 names (the loaders read what was written)."""
    if not np.array_equal(rows, record_tokens(rows[:, 0], width)):
        raise AssertionError("a loader returned bytes that are not the record its id names")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=50_000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8, help="global batches compared across D")
    p.add_argument("--speed-steps", type=int, default=20, help="batches timed for throughput")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "compare"))
    args = p.parse_args(argv)
    from tqdm import tqdm

    names = [*IN_PROCESS, STREAMING]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zephon-compare-data-") as tmp:
        root = Path(tmp)
        write_all(root, args.records, args.width)
        bar = tqdm(total=len(names) * 4, desc="compare", unit="run")
        for name in names:
            ref = global_batches(name, root, args.records, args.width, args.batch, 1, args.steps)
            for b in ref:
                check_rows(b, args.width)
            row: dict[str, Any] = {}
            bar.update()
            for d in (2, 4):
                got = global_batches(name, root, args.records, args.width, args.batch, d, args.steps)
                same_rows = sum(np.array_equal(np.sort(a[:, 0]), np.sort(b[:, 0])) for a, b in zip(ref, got))
                same_order = sum(np.array_equal(a, b) for a, b in zip(ref, got))
                row[f"D={d}"] = {"same_rows": int(same_rows), "same_order": int(same_order)}
                bar.update()
            row["rows_per_s"] = throughput(name, root, args.records, args.width, args.batch, args.speed_steps)
            bar.update()
            results[name] = row
        bar.close()

    z = results["Zephon (Loader, rank/world)"]["rows_per_s"]
    lines = [f"| loader | global batches equal to D=1's at D=2 (rows / order) | at D=4 | rows/s (D=1, B={args.batch}) "
             "| Zephon's rows/s ÷ its |", "|---|---|---|---|---|"]
    for name, row in results.items():
        d2, d4 = row["D=2"], row["D=4"]
        lines.append(f"| {name} | {d2['same_rows']}/{args.steps} / {d2['same_order']}/{args.steps} "
                     f"| {d4['same_rows']}/{args.steps} / {d4['same_order']}/{args.steps} "
                     f"| {row['rows_per_s']:,.0f} | {z / row['rows_per_s']:.2f}× |")
    table = "\n".join(lines)
    print(table)

    versions = {}
    for pkg in ("zephon-loader", "grain", "torchdata", "torch", "mosaicml-streaming", "datasets"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({
        "args": vars(args), "results": results, "table": table, "versions": versions,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
    }, indent=2))
    plot(results, args, out.with_suffix(".png"))
    return 0


def plot(results: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    short = [n.split(" (")[0] + ("\n" + n.split("(")[1].split(",")[0] if n.startswith("Grain") else "") for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    x = np.arange(len(names))
    for i, d in enumerate((2, 4)):
        a.bar(x + (i - 0.5) * 0.4, [results[n][f"D={d}"]["same_rows"] for n in names], 0.4, label=f"D={d}")
    a.set_xticks(x, short, rotation=20, ha="right")
    a.set_ylabel(f"global batches equal to D=1's (of {args.steps})")
    a.set_title("elastic determinism (same rows)")
    a.legend()
    b.bar(x, [results[n]["rows_per_s"] for n in names], color="tab:gray")
    b.set_xticks(x, short, rotation=20, ha="right")
    b.set_ylabel("rows/s")
    b.set_title(f"throughput, D=1, B={args.batch}, one process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())

"""Time to the first batch on many small shard files: Zephon (ArrayRecord, Parquet, JSONL) vs Grain.

The data set: `--shards` files (default 10,000) of `--per-shard` records each (default 10), every
record 64 int32 tokens (`data.record_tokens`), written once as ArrayRecord shards, Parquet files
and JSON Lines files under `--data-dir` and reused. Each case runs in a fresh Python process that
has already imported its libraries, then times, from a cold source to the first batch in hand:

  zephon array_record   ArrayRecordSource(paths) -> Source.shuffle.lanes(8).batch(64) -> next()
  zephon parquet        ParquetSource(paths), the same plan
  zephon jsonl          JsonlSource(paths, schema=...), the same plan
  grain array_record    grain.sources.ArrayRecordDataSource(paths) -> MapDataset.source.shuffle
                        .batch(64)[0] (Grain's indexed path, its fastest to a first batch)

The files sit in the page cache (they were written or read just before), so this measures the
per-file work a loader does before it can emit anything (opening, footers, indexes), not the disk.
Cases are repeated `--rounds` times, interleaved; the table shows medians. Open descriptors after
the first batch are counted from /proc/self/fd. Targets (issue 28): Zephon's ArrayRecord first
batch <= Grain's and < 5 s.

    python benchmarks/startup.py                  # writes results/startup.json and startup.png
    python benchmarks/startup.py --shards 1000 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from data import record_tokens  # noqa: E402

WIDTH = 64
BATCH = 64
LANES = 8
SEED = 7
CASES = ["zephon array_record", "grain array_record", "zephon parquet", "zephon jsonl"]
TARGET_S = 5.0


def paths(root: Path, shards: int, fmt: str) -> list[str]:
    ext = {"array_record": "array_record", "parquet": "parquet", "jsonl": "jsonl"}[fmt]
    return [str(root / fmt / f"part-{i:05d}-of-{shards:05d}.{ext}") for i in range(shards)]


def write_data(root: Path, shards: int, per_shard: int) -> None:
    """Writes the three formats once (a manifest marks a complete set)."""
    manifest = root / "manifest.json"
    want = {"shards": shards, "per_shard": per_shard, "width": WIDTH, "version": 1}
    if manifest.exists() and json.loads(manifest.read_text()) == want:
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon.sources.array_record import write_array_record

    t0 = time.perf_counter()
    for fmt in ("array_record", "parquet", "jsonl"):
        (root / fmt).mkdir(parents=True, exist_ok=True)
    for i, (a, p, j) in enumerate(zip(paths(root, shards, "array_record"), paths(root, shards, "parquet"),
                                      paths(root, shards, "jsonl"))):
        tokens = record_tokens(np.arange(i * per_shard, (i + 1) * per_shard), WIDTH)
        write_array_record(a, [row.tobytes() for row in tokens])
        column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), WIDTH)
        pq.write_table(pa.table({"tokens": column}), p)
        with open(j, "w") as f:
            f.writelines(json.dumps({"tokens": row.tolist()}) + "\n" for row in tokens)
    manifest.write_text(json.dumps(want))
    print(f"wrote {shards} shards x {per_shard} records in 3 formats to {root} "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)


def warm(root: Path) -> None:
    """Reads every file once so each case starts with the same (warm) page cache."""
    for fmt in ("array_record", "parquet", "jsonl"):
        for entry in os.scandir(root / fmt):
            with open(entry.path, "rb") as f:
                f.read()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_case(case: str, root: Path, shards: int) -> dict:
    """In the case's own process: time from nothing open to the first batch."""
    system, fmt = case.split(" ")
    files = paths(root, shards, fmt)
    if system == "zephon":
        # the readers' libraries are imported before the clock starts, as `import grain` does
        import pyarrow.parquet  # noqa: F401
        from array_record.python import array_record_module  # noqa: F401

        from zephon import Loader, Pipeline, Source
        from zephon.sources import ArrayRecordSource, FixedFields, JsonlSource, ParquetSource

        fds0 = open_fds()
        t0 = time.perf_counter()
        if fmt == "array_record":
            src = ArrayRecordSource(files, FixedFields({"tokens": ("int32", (WIDTH,))}))
        elif fmt == "parquet":
            src = ParquetSource(files)
        else:
            src = JsonlSource(files, schema={"tokens": "list[int]"})
        t_open = time.perf_counter() - t0
        loader = Loader(Pipeline(Source(len(src)).shuffle(SEED).lanes(LANES).batch(BATCH), src))
        batch = next(iter(loader))
        first = time.perf_counter() - t0
        tokens = np.asarray(batch.data["tokens"])
        ids = tokens[:, 0].astype(np.int64)
    else:
        import grain

        fds0 = open_fds()
        t0 = time.perf_counter()
        src = grain.sources.ArrayRecordDataSource(files)
        t_open = time.perf_counter() - t0
        ds = (grain.MapDataset.source(src).shuffle(seed=SEED)
              .map(lambda b: np.frombuffer(b, np.int32)).batch(BATCH))
        tokens = ds[0]
        first = time.perf_counter() - t0
        ids = tokens[:, 0].astype(np.int64)
    if not np.array_equal(tokens, record_tokens(ids, WIDTH)):
        raise SystemExit(f"{case}: the first batch does not hold the records it names")
    return {"case": case, "first_batch_s": first, "open_s": t_open, "records": len(src),
            "open_fds_after": open_fds() - fds0}


def measure(case: str, root: Path, shards: int, per_shard: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", case, "--data-dir", str(root.parent),
                          "--shards", str(shards), "--per-shard", str(per_shard)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"{case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["case"] for r in rows]
    values = [r["first_batch_s"] for r in rows]
    colors = ["tab:blue" if n.startswith("zephon") else "tab:orange" for n in names]
    ax.barh(names[::-1], values[::-1], color=colors[::-1])
    for y, v in enumerate(values[::-1]):
        ax.text(v, y, f" {v:.2f} s", va="center")
    ax.axvline(TARGET_S, color="gray", ls="--", lw=1)
    ax.set_xlabel("time to first batch (s, median; lower is better)")
    ax.set_title(f"{meta['shards']:,} shard files x {meta['per_shard']} records, batch {BATCH}")
    ax.set_xlim(0, max(values + [TARGET_S]) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--per-shard", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data-dir", default=os.environ.get("ZEPHON_BENCH_DATA", "/tmp/zephon-bench-data"))
    ap.add_argument("--name", default="startup")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    root = Path(args.data_dir) / f"startup-{args.shards}x{args.per_shard}"
    if args.case:
        print(json.dumps(run_case(args.case, root, args.shards)))
        return 0
    write_data(root, args.shards, args.per_shard)
    warm(root)
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            runs[case].append(measure(case, root, args.shards, args.per_shard))
    rows = []
    for case in CASES:
        r = runs[case]
        rows.append({"case": case, "first_batch_s": statistics.median(x["first_batch_s"] for x in r),
                     "open_s": statistics.median(x["open_s"] for x in r),
                     "runs_s": [round(x["first_batch_s"], 3) for x in r],
                     "records": r[0]["records"], "open_fds_after": r[0]["open_fds_after"]})
    grain_s = next(r["first_batch_s"] for r in rows if r["case"] == "grain array_record")
    zephon_s = next(r["first_batch_s"] for r in rows if r["case"] == "zephon array_record")
    meta = {"shards": args.shards, "per_shard": args.per_shard, "rounds": args.rounds, "batch": BATCH,
            "load_avg_before": os.getloadavg(), "cpus": os.cpu_count(),
            "targets": {"zephon_array_record_vs_grain": "<= 1.0", "zephon_array_record_s": f"< {TARGET_S}"},
            "zephon_vs_grain": zephon_s / grain_s,
            "met": zephon_s <= grain_s and zephon_s < TARGET_S}
    print(f"{'case':<22}{'first batch':>12}{'open':>9}{'fds open':>10}   runs")
    for r in rows:
        print(f"{r['case']:<22}{r['first_batch_s']:>10.2f} s{r['open_s']:>7.2f} s"
              f"{r['open_fds_after']:>10}   {r['runs_s']}")
    print(f"zephon / grain (ArrayRecord) = {meta['zephon_vs_grain']:.2f} (target <= 1); "
          f"zephon {zephon_s:.2f} s (target < {TARGET_S} s): {'met' if meta['met'] else 'MISSED'}")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, meta, out / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What telemetry costs: the same loaders with `telemetry=True` (the default) and `telemetry=False`.

Cases, global shuffle, 8 lanes:
  array_record  the `make bench` data set (100k records x 256 int32 in 4 ArrayRecord shards,
                `data.prepare`): Loader and TorchLoader at batch 64 and 1024 (one-to-one), and
                the Loader through the lane engine (a batched Filter keeping 7/8) at both sizes;
                these rows decide the target
  memory        records of 64 int32 in memory (`ArraySource`), batch 64, one-to-one and filter:
                a loader doing almost nothing per step, so telemetry's fixed per-step cost
                (a few microseconds) is as large a share as it gets; reported, not the target
Every case runs on and off in alternation (the order flips every round), `--rounds` times, each
pass `--seconds` long after a short warm-up, in this one process; the table shows the median
rows/s and on / off. Target (issue 28): on / off >= 0.98 on the array_record rows.

    python benchmarks/telemetry.py             # writes results/telemetry.json and telemetry.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from zephon import Filter, How, Loader, Pipeline, Source
from zephon.sources import ArraySource

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TARGET = 0.98
CASES = [("array_record", "numpy", 64, False), ("array_record", "torch", 64, False),
         ("array_record", "numpy", 1024, False), ("array_record", "torch", 1024, False),
         ("array_record", "numpy", 64, True), ("array_record", "numpy", 1024, True),
         ("memory", "numpy", 64, False), ("memory", "numpy", 64, True)]


def keep_most(cols: dict[str, np.ndarray]) -> np.ndarray:
    return cols["tokens"][:, 0] % 8 != 0


def sources(data_dir: str) -> dict[str, Any]:
    import data

    from zephon.sources import ArrayRecordSource, FixedFields

    ds = data.prepare(data_dir, 100_000, 256, 4)
    ids = np.arange(200_000, dtype=np.int64)
    return {"array_record": ArrayRecordSource(ds.array_record_paths, FixedFields({"tokens": ("int32", (256,))})),
            "memory": ArraySource({"tokens": (ids[:, None] + np.arange(64)).astype(np.int32)})}


def make(src: Any, emitter: str, batch: int, engine: bool, telemetry: bool) -> Any:
    plan = Source(len(src)).shuffle(3).repeat().lanes(8).batch(batch)
    ops = [Filter(keep_most, batched=True)] if engine else []
    if emitter == "torch":
        from zephon.backends.torch import TorchLoader

        return TorchLoader(Pipeline(plan, src, ops), how=How(telemetry=telemetry))
    return Loader(Pipeline(plan, src, ops), how=How(telemetry=telemetry))


def name(kind: str, emitter: str, batch: int, engine: bool) -> str:
    return (f"{kind} {'Loader' if emitter == 'numpy' else 'TorchLoader'} B={batch} "
            f"{'filter' if engine else 'one-to-one'}")


def rate(loader, seconds: float, batch: int) -> float:
    it = iter(loader)
    warm = time.perf_counter() + min(0.5, seconds / 4)
    while time.perf_counter() < warm:
        next(it)
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while True:
        next(it)
        n += 1
        if n % 8 == 0 and time.perf_counter() >= end:
            break
    return n * batch / (time.perf_counter() - t0)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    names = [r["case"] for r in rows][::-1]
    ratios = [r["on_over_off"] for r in rows][::-1]
    ax.barh(names, ratios, color=["tab:green" if x >= TARGET else "tab:red" for x in ratios])
    for y, v in enumerate(ratios):
        ax.text(v, y, f" {v:.3f}", va="center")
    ax.axvline(TARGET, color="gray", ls="--", lw=1)
    ax.axvline(1.0, color="black", lw=0.5)
    ax.set_xlim(0.9, 1.06)
    ax.set_xlabel("throughput with telemetry / without (median)")
    fig.subplots_adjust(left=0.42, right=0.97, bottom=0.15)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--name", default="telemetry")
    ap.add_argument("--data-dir", default=str(HERE / "data"), help="where data sets are cached (as run.py)")
    args = ap.parse_args(argv)
    srcs = sources(args.data_dir)
    samples: dict[tuple, dict[bool, list[float]]] = {c: {True: [], False: []} for c in CASES}
    load = os.getloadavg()
    for r in range(args.rounds):
        for case in CASES:
            for tel in ((True, False) if r % 2 == 0 else (False, True)):
                loader = make(srcs[case[0]], *case[1:], telemetry=tel)
                samples[case][tel].append(rate(loader, args.seconds, case[2]))
                loader.close()
    rows = []
    for case, s in samples.items():
        on, off = statistics.median(s[True]), statistics.median(s[False])
        rows.append({"case": name(*case), "target_row": case[0] == "array_record",
                     "rows_per_s_on": on, "rows_per_s_off": off, "on_over_off": on / off,
                     "on_runs": s[True], "off_runs": s[False]})
    worst = min(r["on_over_off"] for r in rows if r["target_row"])
    meta = {"rounds": args.rounds, "seconds": args.seconds, "cases": [name(*c) for c in CASES],
            "load_avg_before": load, "load_avg_after": os.getloadavg(), "target": TARGET,
            "worst_on_over_off": worst,
            "median_on_over_off": statistics.median(r["on_over_off"] for r in rows if r["target_row"]),
            "met": worst >= TARGET}
    print(f"{'case':<44}{'off rows/s':>14}{'on rows/s':>14}{'on/off':>9}")
    for r in rows:
        print(f"{r['case']:<44}{r['rows_per_s_off']:>14,.0f}{r['rows_per_s_on']:>14,.0f}{r['on_over_off']:>9.3f}")
    print(f"array_record rows: worst on/off {worst:.3f}, median {meta['median_on_over_off']:.3f} (target >= {TARGET}): "
          f"{'met' if meta['met'] else 'MISSED'}; load {load[0]:.1f} -> {meta['load_avg_after'][0]:.1f}")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, out / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Read-ahead of a Grain-shaped pipeline: the Grain layer's former 2048 rows vs the core's default.

The Grain-compatible layer had its own read-ahead default (2048 rows, `zg.READ_AHEAD`), on the
reasoning that Grain records pass through Python transforms one by one, so large group reads buy
little throughput while the loader waits for the whole group before the second batch — and
after every restore. This measures both sides, in one run, for the same pipeline:

  Dataset.source(100k dict records).shuffle().repeat().map(parse).batch(64).lanes(8)

read with `How(read_ahead=R)` for R = 2048 (the Grain layer's former default) and R =
READ_AHEAD_ROWS (the core's), on the inline runner and on `threads(2)`:

  second batch   seconds from the first batch to the second (the first group read)
  restore        seconds from `restore(state)` of step 50 to the second batch after it
  batches/s      steady rate over the next `--steps` batches

Rounds are interleaved; the table shows medians. The batches are the same for every R (asserted).
The latest run (results/grain_read_ahead.json) found the core's default 1.2-1.6x faster in steady
state, at a cost of 0.07-0.16 s more before the second batch and after a restore: no reason for a
second default, so the Grain layer now uses the core's (`How(read_ahead=None)`).

    python benchmarks/grain_read_ahead.py        # writes results/grain_read_ahead.{json,png}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import zephon
import zephon.compat.grain as zg
from zephon.exec.steps import READ_AHEAD_ROWS
from zephon.runners import threads

HERE = Path(__file__).resolve().parent
RECORDS, BATCH, LANES, WIDTH = 100_000, 64, 8, 16


def parse(record: dict) -> dict:
    return {"x": record["x"] * 2, "y": record["y"] + 1}


def dataset() -> zg.Dataset:
    recs = [{"x": np.arange(WIDTH, dtype=np.int32) + i, "y": i} for i in range(RECORDS)]
    return zg.Dataset.source(recs).shuffle(seed=1).repeat().map(parse).batch(BATCH).lanes(LANES)


def one(ds: zg.Dataset, runner: str, read_ahead: int, steps: int) -> dict[str, float]:
    def how() -> zephon.How:
        return zephon.How(runner=threads(2) if runner == "threads:2" else None, read_ahead=read_ahead)

    loader = ds.loader(how=how())
    next(loader)
    t0 = time.perf_counter()
    next(loader)
    second = time.perf_counter() - t0
    state = None
    t0 = time.perf_counter()
    for _ in range(steps):
        last = next(loader)
        if loader.step == 50:
            state = loader.state()
    rate = steps / (time.perf_counter() - t0)
    loader.close()
    again = ds.loader(how=how())
    assert state is not None, "--steps must be at least 50"
    t0 = time.perf_counter()
    again.restore(state)
    next(again)
    b = next(again)
    restore = time.perf_counter() - t0
    again.close()
    return {"second_batch_s": second, "restore_s": restore, "batches_per_s": rate,
            "check": int(last.data["y"].sum()) + int(b.data["y"].sum())}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    names = [f"{r['runner']}\nR={r['read_ahead']}" for r in rows]
    for ax, key, label in zip(axes, ("second_batch_s", "restore_s", "batches_per_s"),
                              ("second batch (s)", "restore -> 2nd batch (s)", "batches/s")):
        vals = [r[key] for r in rows]
        ax.bar(names, vals, color=["tab:gray" if r["read_ahead"] != READ_AHEAD_ROWS else "tab:blue" for r in rows])
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("Grain-shaped pipeline: read-ahead 2048 (former Grain default) vs the core's (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4096)
    ap.add_argument("--out", default=str(HERE / "results" / "grain_read_ahead"))
    args = ap.parse_args(argv)
    ds = dataset()
    cases = [(r, ra) for r in ("inline", "threads:2") for ra in (2048, READ_AHEAD_ROWS)]
    got: dict[tuple[str, int], list[dict[str, float]]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for c in cases:
            got[c].append(one(ds, *c, args.steps))
    checks = {m["check"] for ms in got.values() for m in ms}
    assert len(checks) == 1, f"the batches differ with the read-ahead: {checks}"
    rows = [{"runner": r, "read_ahead": ra,
             **{k: statistics.median(m[k] for m in got[(r, ra)]) for k in ("second_batch_s", "restore_s",
                                                                           "batches_per_s")}}
            for r, ra in cases]
    for r in rows:
        print(f"{r['runner']:>10} R={r['read_ahead']:>6}  second batch {r['second_batch_s'] * 1e3:7.1f} ms  "
              f"restore {r['restore_s'] * 1e3:7.1f} ms  {r['batches_per_s']:7.0f} batches/s")
    doc = {"command": "python benchmarks/grain_read_ahead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "rounds": args.rounds, "steps": args.steps,
           "pipeline": f"Dataset.source({RECORDS} dict records).shuffle().repeat().map(parse).batch({BATCH})"
                       f".lanes({LANES})", "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, Path(args.out + ".png"))
    print(f"wrote {args.out}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

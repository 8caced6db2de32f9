"""Steady soak: the packed LM pipeline on `processes(2)` for a fixed duration; are resources flat?

`make soak DURATION=600` (this part) or `python benchmarks/soak_steady.py --duration 600`.

The soak's pipeline (`benchmarks/soak.py`: two JSONL corpora mixed 0.7/0.3 by tokens in 8 lanes,
per-source `Tokenize`, `Pack(256)`, batch 16) runs uninterrupted on one loader with
`processes(2)` for `--duration` seconds. Every second a sample: the consumer's open descriptors,
its memfd descriptors and memfd mappings, its RSS, and the workers' RSS — and of each RSS its
private part (RssAnon: heap and arrays, without the shared-memory slots RSS also counts). After a warm-up (the
first `--warmup` fraction of the run) a least-squares line is fitted to each series; the report
gives each slope per minute and the rise it predicts over the rest of the run, and fails (exit 1)
when a series still rises: slope × measured span above `--tolerance` of its level (RSS) or more
than 2 (descriptors, mappings) — a leak grows without bound, noise does not.

Writes benchmarks/results/soak_steady.json (and .png with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import RESULTS, Job, _mappings, _memfd_fds

from zephon.runners import processes

SERIES = ("fds", "memfds", "memfd_maps", "rss_mb", "workers_rss_mb", "anon_mb", "workers_anon_mb")
COUNTS = ("fds", "memfds", "memfd_maps")


def anon_mb(pid: int | str = "self") -> float:
    """RssAnon: the process's private memory (heap, arrays), without the shared-memory slots and
    mapped files that RSS also counts."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def sample(me: psutil.Process, workers: list[int]) -> dict[str, float]:
    wrss = wanon = 0.0
    for pid in workers:
        try:
            wrss += psutil.Process(pid).memory_info().rss / 2**20
            wanon += anon_mb(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return {"fds": len(os.listdir("/proc/self/fd")), "memfds": _memfd_fds(), "memfd_maps": _mappings()[0],
            "rss_mb": me.memory_info().rss / 2**20, "workers_rss_mb": wrss,
            "anon_mb": anon_mb(), "workers_anon_mb": wanon}


def slopes(t: np.ndarray, rows: list[dict[str, float]], start: float) -> dict[str, dict[str, float]]:
    keep = t >= start
    out = {}
    for k in SERIES:
        y = np.array([r[k] for r in rows], np.float64)[keep]
        x = t[keep]
        slope = float(np.polyfit(x, y, 1)[0]) if len(x) > 2 else 0.0
        span = float(x[-1] - x[0]) if len(x) else 0.0
        y = y if len(y) else np.zeros(1)
        out[k] = {"slope_per_min": round(slope * 60, 4), "rise_over_span": round(slope * span, 3),
                  "first": round(float(y[0]), 2), "last": round(float(y[-1]), 2),
                  "min": round(float(y.min()), 2), "max": round(float(y.max()), 2)}
    return out


def verdict(t: np.ndarray, rows: list[dict[str, float]], warmup: float, tolerance: float
            ) -> tuple[dict[str, dict[str, float]], dict[str, bool]]:
    """The fit after the warm-up (`warmup`: fraction of the run) and, per series, whether it is
    flat: the rise the fitted line predicts over the measured span is at most 2 (descriptors,
    mappings) or `tolerance` of the series' first level after warm-up (RSS)."""
    fit = slopes(t, rows, warmup * float(t[-1]))
    flat = {}
    for k, f in fit.items():
        allowed = 2.0 if k in COUNTS else tolerance * max(f["first"], 1.0)
        flat[k] = f["rise_over_span"] <= allowed
    return fit, flat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of loading (default 600)")
    ap.add_argument("--warmup", type=float, default=0.25, help="fraction of the run left out of the fit")
    ap.add_argument("--tolerance", type=float, default=0.05, help="RSS rise allowed after warm-up (fraction)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "soak_steady"))
    args = ap.parse_args()
    me = psutil.Process()
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(tmp, 1500, 700)
        runner = processes(2)
        loader = job.loader(runner=runner)
        times: list[float] = []
        rows: list[dict[str, float]] = []
        steps = [0]
        halt = threading.Event()

        def watch() -> None:
            t0 = time.monotonic()
            while not halt.wait(1.0):
                rows.append(sample(me, list(runner.pids)))
                times.append(time.monotonic() - t0)

        t0 = time.monotonic()
        th = threading.Thread(target=watch, daemon=True)
        th.start()
        try:
            while time.monotonic() - t0 < args.duration:
                next(loader)
                steps[0] += 1
        finally:
            halt.set()
            th.join()
            loader.close()
        after = sample(me, [])
    t = np.array(times)
    fit, flat = verdict(t, rows, args.warmup, args.tolerance)
    report = {"duration_s": round(float(t[-1]), 1), "steps": steps[0], "warmup_s": round(args.warmup * float(t[-1]), 1),
              "load_avg": os.getloadavg(), "cpus": os.cpu_count(), "after_close": after,
              "fit_after_warmup": fit, "flat": flat, "ok": all(flat.values()),
              "samples": [{"t": round(float(x), 2), **{k: round(v, 2) for k, v in r.items()}}
                          for x, r in zip(t, rows)]}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(f"{args.out}.json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"steady soak: {steps[0]} steps in {report['duration_s']} s on processes(2), load {report['load_avg']}")
    print(f"{'series':>16} {'first':>9} {'last':>9} {'min':>9} {'max':>9} {'slope/min':>10} {'rise':>8}  flat")
    for k, f in fit.items():
        print(f"{k:>16} {f['first']:>9} {f['last']:>9} {f['min']:>9} {f['max']:>9} {f['slope_per_min']:>10} "
              f"{f['rise_over_span']:>8}  {'yes' if flat[k] else 'NO'}")
    print(f"after close: {after}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
        for k in COUNTS:
            axes[0].plot(t, [r[k] for r in rows], label=k)
        for k in ("rss_mb", "workers_rss_mb", "anon_mb", "workers_anon_mb"):
            axes[1].plot(t, [r[k] for r in rows], label=k)
        for ax in axes:
            ax.axvline(args.warmup * float(t[-1]), color="grey", ls="--", lw=0.8)
            ax.set_xlabel("seconds")
            ax.legend(fontsize=8)
        axes[0].set_title("consumer descriptors and memfd mappings", fontsize=9)
        axes[1].set_title("RSS (MB)", fontsize=9)
        fig.tight_layout()
        fig.savefig(f"{args.out}.png", dpi=100)
    except ImportError:
        print("no PNG: matplotlib is not installed (pip install 'zephon-loader[plots]')")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

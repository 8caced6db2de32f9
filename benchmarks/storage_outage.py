"""A storage outage mid-epoch (issue 38): the server stopped for 10 s and started again over the
same data, with the default retry policy (deadline 120 s, backoff 0.2 s doubling to 10 s).

Data: ArrayRecord, 40k x 256 int32 (4 shards), on s3:// (SeaweedFS) and gs:// (fake-gcs-server),
both on 127.0.0.1. Plan: global shuffle, 8 lanes, B = 256, one epoch (156 steps), the loader's
default read-ahead. For each store and runner (inline, processes(2)): the epoch uninterrupted,
then again with the server halted after a third of the epoch for `--outage` seconds and restarted
on the same ports over the same data. Reported: errors (the target: 0), whether every step's
fingerprint equals the uninterrupted run's and the local files' (the target: identical), how long
the server was down, the longest wait between two batches, how long after the server was back
the next batch came, and the epoch's wall time with and without the outage.

Writes benchmarks/results/storage_outage.{json,png}. Run under the bench lock:
  flock /tmp/zephon-bench.lock .venv/bin/python benchmarks/storage_outage.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zephon import How, Loader, Pipeline, Source, storage  # noqa: E402
from zephon.fingerprints import lane_digests, step_fingerprint  # noqa: E402
from zephon.runners import inline, processes  # noqa: E402
from zephon.sources import ArrayRecordSource, FixedFields, write_sharded_array_record  # noqa: E402
from zephon.testing.object_servers import Server, create_bucket, start_fake_gcs, start_seaweedfs  # noqa: E402

BUCKET = "zephon-outage"
SPEC = FixedFields({"tokens": ("int32", (256,))})


def _loader(url: str, n: int, batch: int, runner: str) -> Loader:
    plan = Source(n).shuffle(3).repeat().lanes(8).batch(batch)
    return Loader(Pipeline(plan, ArrayRecordSource(url, SPEC)),
                  how=How(runner=inline() if runner == "inline" else processes(2)))


def _epoch(loader: Loader, steps: int, server: Server | None = None, halt_at: int = 0,
           outage: float = 0.0) -> dict:
    """Runs `steps` steps on a helper thread; with `server`, halts it after step `halt_at` for
    `outage` seconds from this (the main) thread, then restarts it."""
    fps: list[str] = []
    times: list[float] = []
    out: dict = {}
    reached, halted_ev = threading.Event(), threading.Event()

    def consume() -> None:
        try:
            for step in range(steps):
                if step == halt_at and server is not None:
                    reached.set()
                    halted_ev.wait()  # the next step is asked for with the server down
                fps.append(step_fingerprint(lane_digests(next(loader))))
                times.append(time.monotonic())
        except Exception as e:  # reported, not raised: the error is the measurement
            out["error"] = f"{type(e).__name__}: {e}"
        reached.set()

    t0 = time.monotonic()
    worker = threading.Thread(target=consume, daemon=True)
    worker.start()
    if server is not None:
        reached.wait()
        server.halt()
        halted = time.monotonic()
        halted_ev.set()
        time.sleep(outage)
        server.restart()
        up = time.monotonic()
        out.update(down_s=up - halted, halted_at_s=halted - t0, up_at_s=up - t0)
    worker.join()
    gaps = np.diff([t0, *times])
    out.update(fingerprints=fps, times_s=[t - t0 for t in times], wall_s=time.monotonic() - t0,
               longest_gap_s=float(gaps.max()) if len(gaps) else 0.0)
    if server is not None:
        later = [t - t0 for t in times if t - t0 > out["up_at_s"]]
        out["next_batch_after_up_s"] = later[0] - out["up_at_s"] if later else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=40_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--outage", type=float, default=10.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "storage_outage"))
    args = ap.parse_args()
    steps = args.records // args.batch
    halt_at = steps // 3
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    pol = storage.policy()
    servers = {}
    saved = dict(os.environ)
    results = []
    try:
        servers["s3"] = start_seaweedfs()
        servers["gs"] = start_fake_gcs()
        for s in servers.values():
            os.environ.update(s.env)
        storage.reset()
        with tempfile.TemporaryDirectory() as tmp:
            rng = np.random.default_rng(0)
            recs = rng.integers(0, 50_000, size=(args.records, 256), dtype=np.int32)
            write_sharded_array_record(Path(tmp) / "ar", [r.tobytes() for r in recs], 4)
            local_url = f"{tmp}/ar@4"
            with _loader(local_url, args.records, args.batch, "inline") as loader:
                local = _epoch(loader, steps)["fingerprints"]
            for scheme, server in servers.items():
                create_bucket(server, BUCKET)
                for f in sorted(Path(tmp).iterdir()):
                    storage.put_atomic(f"{scheme}://{BUCKET}/{f.name}", f.read_bytes())
        for scheme, server in servers.items():
            url = f"{scheme}://{BUCKET}/ar@4"
            for runner in ("inline", "processes"):
                with _loader(url, args.records, args.batch, runner) as loader:
                    plain = _epoch(loader, steps)
                with _loader(url, args.records, args.batch, runner) as loader:
                    hit = _epoch(loader, steps, server, halt_at, args.outage)
                row = {
                    "store": scheme, "runner": runner, "steps": steps, "halted_after_step": halt_at,
                    "errors": int("error" in hit) + int("error" in plain), "error": hit.get("error"),
                    # a batch came after the server was back: the loader met the outage (not
                    # everything was read ahead before it)
                    "outage_met": hit.get("next_batch_after_up_s") is not None,
                    "identical_to_uninterrupted": hit["fingerprints"] == plain["fingerprints"],
                    "identical_to_local": hit["fingerprints"] == local,
                    "down_s": round(hit["down_s"], 2), "halted_at_s": round(hit["halted_at_s"], 2),
                    "longest_gap_s": round(hit["longest_gap_s"], 2),
                    "next_batch_after_up_s": None if hit.get("next_batch_after_up_s") is None
                    else round(hit["next_batch_after_up_s"], 2),
                    "wall_s": round(hit["wall_s"], 2), "wall_uninterrupted_s": round(plain["wall_s"], 2),
                    "times_s": [round(t, 3) for t in hit["times_s"]],
                }
                results.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "times_s"}), flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        storage.reset()
        for s in servers.values():
            s.stop()
    doc = {
        "what": "a storage server stopped mid-epoch and restarted over the same data (issue 38)",
        "command": "flock /tmp/zephon-bench.lock .venv/bin/python benchmarks/storage_outage.py",
        "records": args.records, "batch": args.batch, "outage_s": args.outage,
        "policy": {k: getattr(pol, k) for k in ("deadline", "timeout", "backoff", "max_backoff", "attempts")},
        "loadavg_before": load_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    _plot(doc, args.out + ".png")


def _plot(doc: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in doc["results"]:
        line = ax.plot(r["times_s"], range(1, len(r["times_s"]) + 1),
                       label=f"{r['store']} {r['runner']}: {r['errors']} errors, "
                             f"{'identical' if r['identical_to_uninterrupted'] else 'DIFFERENT'}")[0]
        ax.axvspan(r["halted_at_s"], r["halted_at_s"] + r["down_s"], color=line.get_color(),
                   alpha=0.08, lw=0)
        ax.axvline(r["halted_at_s"] + r["down_s"], color=line.get_color(), ls=":", lw=0.8)
    ax.set_xlabel("seconds since the epoch started (shaded: the server down; dotted: back up)")
    ax.set_ylabel("steps delivered")
    ax.set_title(f"{doc['outage_s']:g} s storage outage mid-epoch, default retry policy "
                 f"(deadline {doc['policy']['deadline']:g} s)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

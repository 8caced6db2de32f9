"""Object storage (issue 21): the same data as local files, on s3:// (SeaweedFS) and gs://
(fake-gcs-server), read through the fault proxy with 0 ms and 20 ms added latency per request.

Data: ArrayRecord 100k x 256 int32 (random values < 50000: ~750 B a record on disk after zstd;
4 shards) and a Parquet
text corpus (100k documents, row groups of 1000). Plan: global shuffle, 8 lanes, B = 64 and 1024.
For each (format, storage, latency, B): rows/s over the first batch and the loader's first
read-ahead window after it (1 + 16384 / B steps: every row fetched is a row used), time to first
batch (source construction included: footers, listing, pinning), and bytes
fetched / bytes needed (needed: the bytes of the format's smallest unit holding the rows read —
an ArrayRecord chunk, a Parquet row group's column chunks). Baseline "download first": every
object copied to local disk (what Streaming, litdata and zephon 0.2.0 do), then read locally;
its time to first batch includes the download.

The time-to-first-batch target (>= 10x shorter than download-first on >= 1 GB) runs on an
ArrayRecord set of at least 1 GiB on disk (~1.45M x 256 int32, 8 shards; its size is measured and
reported) on s3:// and gs:// at 0 ms (--ttfb-gib 0 skips it). Download-first fetches all objects
concurrently (as many requests in flight as the ranged reader uses).

Writes benchmarks/results/storage.json and storage.png. Run under the bench lock:
  flock /tmp/zephon-bench.lock .venv/bin/python benchmarks/storage.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zephon import How, Loader, Pipeline, Source, Where, storage  # noqa: E402
from zephon.plan.blockshuffle import block_shuffles  # noqa: E402
from zephon.sources import (  # noqa: E402
    ArrayRecordSource,
    FixedFields,
    ParquetSource,
    write_array_record,
    write_parquet,
)
from zephon.sources.paths import shard_name  # noqa: E402
from zephon.testing.object_servers import create_bucket, start_fake_gcs, start_seaweedfs  # noqa: E402

BUCKET = "zephon-bench"
SPEC = FixedFields({"tokens": ("int32", (256,))})


def write_data(root: Path, n_ar: int, n_pq: int, shards: int = 4) -> dict[str, str]:
    """Record i is row i of a seeded random (n_ar, 256) int32 matrix, generated a shard at a time
    (a 1 GiB set never sits in memory twice)."""
    bounds = np.arange(shards + 1) * n_ar // shards
    for i, (start, stop) in enumerate(itertools.pairwise(bounds.tolist())):
        rng = np.random.default_rng([0, i])
        recs = rng.integers(0, 50_000, size=(stop - start, 256), dtype=np.int32)
        write_array_record(shard_name(str(root / "ar"), i, shards), (r.tobytes() for r in recs))
    if n_pq:
        rng = np.random.default_rng(0)
        words = np.array(["the", "data", "loader", "shard", "object", "storage", "range", "batch"])
        lens = rng.integers(20, 200, size=n_pq)
        docs = np.array([" ".join(words[rng.integers(0, 8, size=k)]) for k in lens], dtype=object)
        write_parquet(root / "text.parquet", {"id": np.arange(n_pq), "text": docs}, row_group_size=1000)
    return {"ar": f"ar@{shards}", "pq": "text.parquet"}


def upload(root: Path, scheme: str, prefix: str) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda f: storage.put_atomic(f"{scheme}://{BUCKET}/{prefix}/{f.name}", f.read_bytes()),
                      sorted(root.iterdir())))
    return time.perf_counter() - t0


def make_source(kind: str, base: str, names: dict[str, str]):
    if kind == "ar":
        return ArrayRecordSource(f"{base}/{names['ar']}", SPEC)
    return ParquetSource(f"{base}/{names['pq']}", columns=["text"], cache_row_groups=0)


def needed_bytes(kind: str, src, rows: np.ndarray) -> int:
    """Bytes of the smallest units holding `rows` (see the module doc)."""
    if kind == "ar":
        total = 0
        shard = np.searchsorted(src._ends, rows, side="right")
        for s in np.unique(shard):
            local = rows[shard == s] - src._starts[s]
            r = src._reader(int(s))
            c = np.unique(np.searchsorted(r.chunk_first, local, side="right") - 1)
            total += int((r.chunk_end[c] - r.chunk_begin[c]).sum())
        return total
    groups = np.unique(np.searchsorted(src._group_ends, rows, side="right"))
    f = src._opened(0)
    return int(sum(f.metadata.row_group(int(g)).column(f.schema_arrow.get_field_index("text")).total_compressed_size
                   for g in groups))


def run_case(kind: str, base: str, names: dict[str, str], batch: int, rows_target: int,
             shuffle: str = "global") -> dict:
    """One case. `shuffle="block"`: the block shuffle with its defaults (block = the source's
    natural unit, window = 2 × B blocks, one stripe per lane), `rows_target` rows counted from
    the first batch on (a whole epoch: a window's blocks are fetched once and used all epoch)."""
    bytes0, req0 = storage.STATS["bytes"], storage.STATS["requests"]
    t0 = time.perf_counter()
    src = make_source(kind, base, names)
    stream = Source(len(src))
    stream = stream.shuffle(7) if shuffle == "global" else stream.block_shuffle(7)
    plan = stream.repeat().lanes(8).batch(batch)
    if shuffle == "global":
        steps = 1 + max(1, rows_target // batch)  # the first batch, then whole read-ahead windows
    else:
        steps = max(1, rows_target // batch)
    t1 = time.perf_counter()
    with Loader(Pipeline(plan, src)) as loader:
        plan = loader.plan  # block="auto" resolved
        it = iter(loader)
        next(it)
        ttfb = time.perf_counter() - t0
        for _ in range(steps - 1):
            next(it)
        rate = steps * batch / (time.perf_counter() - t1)
    fetched = storage.STATS["bytes"] - bytes0
    need = 0
    rows = np.unique(np.concatenate([plan.refs(s).record for s in range(steps)]))
    if fetched:
        need = needed_bytes(kind, src, rows)
    out = {"shuffle": shuffle, "rows_per_s": rate, "ttfb_s": ttfb, "bytes_fetched": fetched,
           "bytes_needed": need, "fetched_over_needed": fetched / need if fetched else None,
           "requests": storage.STATS["requests"] - req0, "steps": steps, "rows": steps * batch}
    out["requests_per_row"] = out["requests"] / out["rows"]
    if shuffle == "block":
        node = block_shuffles(plan)[0]
        out.update(block=node.block, window=node.window, stripes=node.stripes)
        stats = src.block_stats()
        if stats is not None:
            out["window_memory"] = stats if isinstance(stats, dict) else vars(stats)
    return out


def block_ranges(kind: str, src, block: int) -> list[tuple[str, int, int]]:
    """The byte ranges a block-shuffled epoch needs: every block's chunks (ArrayRecord, one range
    per block and shard) or every row group's column chunk (Parquet); (url, offset, length)."""
    out = []
    if kind == "ar":
        b = int(block)
        for k in range(-(-len(src) // b)):
            lo, hi = k * b, min(len(src), (k + 1) * b) - 1
            for s in range(int(np.searchsorted(src._ends, lo, side="right")),
                           int(np.searchsorted(src._ends, hi, side="right")) + 1):
                r = src._reader(s)
                a = max(lo, int(src._starts[s])) - int(src._starts[s])
                z = min(hi, int(src._ends[s]) - 1) - int(src._starts[s])
                c0 = int(np.searchsorted(r.chunk_first, a, side="right") - 1)
                c1 = int(np.searchsorted(r.chunk_first, z, side="right") - 1)
                out.append((src.paths[s], int(r.chunk_begin[c0]), int(r.chunk_end[c1] - r.chunk_begin[c0])))
        return out
    f = src._opened(0)
    col = f.schema_arrow.get_field_index("text")
    for g in range(f.metadata.num_row_groups):
        cc = f.metadata.row_group(g).column(col)
        start = cc.dictionary_page_offset if cc.has_dictionary_page else cc.data_page_offset
        out.append((src.paths[0], int(start), int(cc.total_compressed_size)))
    return out


def ceiling_for(ranges: list[tuple[str, int, int]], rows: int) -> dict:
    """The server's own ceiling for these ranges: one process fetching them straight (no loader,
    no decoding), every object's ranges in flight together; in rows/s of the rows they hold."""
    by_url: dict[str, list[tuple[int, int]]] = {}
    for url, off, n in ranges:
        by_url.setdefault(url, []).append((off, n))
    blobs = {url: storage.open_blob(url) for url in by_url}
    req0 = storage.STATS["requests"]
    t0 = time.perf_counter()
    storage.read_blobs([(blobs[u], r) for u, r in by_url.items()])
    wall = time.perf_counter() - t0
    return {"rows_per_s": rows / wall, "seconds": wall, "requests": storage.STATS["requests"] - req0,
            "bytes": sum(n for _, _, n in ranges)}


def download_first(kind: str, scheme: str, prefix: str, names: dict[str, str], batch: int,
                   rows_target: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="zephon-dl-"))
    try:
        t0 = time.perf_counter()
        blobs = [storage.open_blob(url) for url, _ in storage.list_objects(f"{scheme}://{BUCKET}/{prefix}/")]
        for blob, (data,) in zip(blobs, storage.read_blobs([(b, [(0, b.size)]) for b in blobs])):
            (tmp / blob.url.rsplit("/", 1)[1]).write_bytes(data)
        dl = time.perf_counter() - t0
        case = run_case(kind, str(tmp), names, batch, rows_target)
        case["ttfb_s"] += dl
        case["download_s"] = dl
        return case
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class ProxyProcess:
    """The fault proxy in its own process (its work must not share this process's GIL)."""

    def __init__(self, upstream: str, latency: float, rewrite_host: bool) -> None:
        args = [sys.executable, "-m", "zephon.testing.fault_proxy", upstream, "--latency", str(latency)]
        self.proc = subprocess.Popen(args + (["--rewrite-host"] if rewrite_host else []),
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.endpoint = self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def cpu_seconds(pid: int, group: bool = False) -> float:
    """User + system CPU seconds of process `pid`, all its threads (`group`: of every process
    in its process group: a server started in its own session)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or (group and int(fields[2]) == pid):
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def request_rate(url: str, server_pid: int, proxy_pid: int | None, n: int = 3000) -> dict:
    """Ranged GETs per second one process gets from a server (random 1000-byte ranges, no merging,
    the policy's requests in flight), and the CPU each request costs in this process (obstore and
    Zephon), in the server and in the proxy: where the time of a ranged read goes."""
    blob = storage.open_blob(url)
    offs = np.random.default_rng(3).integers(0, blob.size - 1000, n)
    old = storage.policy()
    storage.configure(overfetch=0.0, merge_gap=0)

    def cpu() -> tuple[float, float, float]:
        return (time.process_time(), cpu_seconds(server_pid, group=True),
                cpu_seconds(proxy_pid) if proxy_pid else 0.0)

    try:
        c0, t0 = cpu(), time.perf_counter()
        blob.read_ranges([(int(o), 1000) for o in offs])
        wall, c1 = time.perf_counter() - t0, cpu()
    finally:
        storage.configure(overfetch=old.overfetch, merge_gap=old.merge_gap)
    return {"requests_per_s": n / wall, **{f"cpu_us_per_request_{k}": (b - a) / n * 1e6
                                           for k, a, b in zip(("client", "server", "proxy"), c0, c1)}}


def block_cases(args, data: Path, names: dict[str, str], proxies: dict, servers: dict) -> list[dict]:
    """Block shuffle (default block and window), B = 1024, a whole epoch a case: local global
    shuffle, local block shuffle, s3 and gs at 0 and 20 ms; then the servers' ceiling for the
    same ranges (one process, no loader, no decoding), straight to each server and through the
    20 ms proxy. Each case is the best of `args.repeats` runs (the machine is shared)."""
    out = []
    batch = 1024

    def best(kind: str, base: str, shuffle: str, rows: int) -> dict:
        runs = [run_case(kind, base, names, batch, rows, shuffle) for _ in range(args.repeats)]
        return max(runs, key=lambda r: r["rows_per_s"])

    for kind in [k for k in args.formats.split(",") if k]:
        epoch = args.records if kind == "ar" else args.docs
        local_global = best(kind, str(data), "global", epoch)
        local_block = best(kind, str(data), "block", epoch)
        local_block["vs_local_global"] = local_block["rows_per_s"] / local_global["rows_per_s"]
        for name, case in (("local global", local_global), ("local block", local_block)):
            out.append({"format": kind, "storage": name, "latency_ms": 0, "batch": batch, **case})
            print(json.dumps(out[-1]), flush=True)
        for scheme in ("s3", "gs"):
            env = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
            ceilings = {}
            for via, endpoint in (("direct", servers[scheme].endpoint),
                                  ("proxy 20 ms", proxies[(scheme, 0.02)].endpoint)):
                os.environ[env] = endpoint
                storage.reset()
                urls = block_ranges(kind, make_source(kind, f"{scheme}://{BUCKET}/d", names), local_block["block"])
                ceilings[via] = max((ceiling_for(urls, local_block["rows"]) for _ in range(args.repeats)),
                                    key=lambda c: c["rows_per_s"])
            for latency in (0.0, 0.02):
                point(proxies, scheme, latency)
                case = best(kind, f"{scheme}://{BUCKET}/d", "block", epoch)
                case["vs_local"] = case["rows_per_s"] / local_block["rows_per_s"]
                case["ceiling"] = ceilings
                case["vs_ceiling"] = case["rows_per_s"] / ceilings["direct"]["rows_per_s"]
                case["ceiling_vs_local"] = ceilings["direct"]["rows_per_s"] / local_block["rows_per_s"]
                out.append({"format": kind, "storage": scheme, "latency_ms": latency * 1000, "batch": batch, **case})
                print(json.dumps(out[-1]), flush=True)
            point(proxies, scheme, 0.0)
        if kind == "ar":
            point(proxies, "s3", 0.02)
            out.append({"format": kind, "storage": "s3", "latency_ms": 20.0, "batch": batch,
                        **ranks_of_64(kind, f"s3://{BUCKET}/d", names, batch)})
            print(json.dumps(out[-1]), flush=True)
            point(proxies, "s3", 0.0)
    return out


def ranks_of_64(kind: str, base: str, names: dict[str, str], batch: int, ranks=(0, 1, 2)) -> dict:
    """D = 64 simulated: a few ranks of 64 (64 lanes), each with its own source (as its own host
    would), two epochs each; the requests each sends per row it reads."""
    per = []
    for rank in ranks:
        src = make_source(kind, base, names)
        plan = Source(len(src)).block_shuffle(7).repeat().lanes(64).batch(batch)
        steps = 2 * (len(src) // batch)
        req0 = storage.STATS["requests"]
        # reads of one epoch of this rank's lane (the default read-ahead, 16384 rows, would read
        # ten epochs of one lane at once: the rows counted are the rows read)
        with Loader(Pipeline(plan, src), Where(rank=rank, world=64), How(read_ahead=len(src) // 64)) as loader:
            for _ in range(steps):
                next(loader)
        stats = src.block_stats()
        rows = steps * batch // 64
        per.append({"rank": rank, "rows": rows, "requests": storage.STATS["requests"] - req0,
                    "requests_per_row": (storage.STATS["requests"] - req0) / rows,
                    "blocks_fetched": stats.fetched, "peak_bytes": stats.peak_bytes,
                    "capacity_blocks": stats.capacity})
    return {"shuffle": "block", "simulated": "D=64, ranks " + ",".join(map(str, ranks)), "ranks": per,
            "requests_per_row": max(p["requests_per_row"] for p in per)}


def point(proxies: dict, scheme: str, latency: float) -> None:
    """Points `scheme`'s client at the proxy with `latency` added per request."""
    env = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
    os.environ[env] = proxies[(scheme, latency)].endpoint
    storage.reset()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--rows", type=int, default=16384,
                    help="rows per case after the first batch (16384 = one read-ahead window of the "
                         "loader, so the rows fetched are the rows used)")
    ap.add_argument("--formats", default="ar,pq")
    ap.add_argument("--ttfb-gib", type=float, default=1.0)
    ap.add_argument("--block-only", action="store_true", help="only the block-shuffle cases")
    ap.add_argument("--repeats", type=int, default=2, help="block-shuffle cases: best of this many")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "storage"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zephon-bench-storage-"))
    servers = []
    load = os.getloadavg()[0]
    try:
        s3, gs = start_seaweedfs(), start_fake_gcs()
        servers += [s3, gs]
        os.environ.update({**s3.env, **gs.env, "ZEPHON_CACHE_DIR": str(work / "cache")})
        storage.reset()
        create_bucket(s3, BUCKET)
        create_bucket(gs, BUCKET)
        data = work / "data"
        data.mkdir()
        names = write_data(data, args.records, args.docs)
        uploads = {scheme: upload(data, scheme, "d") for scheme in ("s3", "gs")}
        proxies = {(scheme, lat): ProxyProcess(srv.endpoint, lat, scheme == "gs")
                   for scheme, srv in (("s3", s3), ("gs", gs)) for lat in (0.0, 0.02)}
        ceiling = []
        for scheme, srv in (("s3", s3), ("gs", gs)) if not args.block_only else ():
            for via in ("direct", "proxy 0 ms"):
                proxy = proxies[(scheme, 0.0)] if via != "direct" else None
                os.environ["AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"] = \
                    proxy.endpoint if proxy else srv.endpoint
                storage.reset()
                rate = request_rate(f"{scheme}://{BUCKET}/d/ar-00000-of-00004", srv.proc.pid,
                                    proxy.proc.pid if proxy else None)
                ceiling.append({"storage": scheme, "via": via, **rate})
                print(json.dumps(ceiling[-1]), flush=True)
        rows = []
        blocks = block_cases(args, data, names, proxies, {"s3": s3, "gs": gs})
        for kind in [k for k in args.formats.split(",") if k and not args.block_only]:
            for batch in (64, 1024):
                ref = run_case(kind, str(data), names, batch, args.rows)
                rows.append({"format": kind, "storage": "local", "latency_ms": 0, "batch": batch, **ref})
                print(json.dumps(rows[-1]), flush=True)
                for scheme in ("s3", "gs"):
                    for latency in (0.0, 0.02):
                        point(proxies, scheme, latency)
                        case = run_case(kind, f"{scheme}://{BUCKET}/d", names, batch, args.rows)
                        case["vs_local"] = case["rows_per_s"] / ref["rows_per_s"]
                        rows.append({"format": kind, "storage": scheme, "latency_ms": latency * 1000,
                                     "batch": batch, **case})
                        print(json.dumps(rows[-1]), flush=True)
                    point(proxies, scheme, 0.0)
                    base = download_first(kind, scheme, "d", names, batch, args.rows)
                    rows.append({"format": kind, "storage": f"{scheme} download-first", "latency_ms": 0,
                                 "batch": batch, **base})
                    print(json.dumps(rows[-1]), flush=True)
        ttfb = []
        if args.ttfb_gib > 0 and not args.block_only:
            big = work / "big"
            big.mkdir()
            per_record = sum(f.stat().st_size for f in data.glob("ar-*")) / args.records
            n = int(args.ttfb_gib * (1 << 30) / per_record * 1.05)  # compressed records: measured
            names_big = write_data(big, n, 0, shards=8)
            size = sum(f.stat().st_size for f in big.iterdir())
            if size < args.ttfb_gib * (1 << 30):
                raise RuntimeError(f"the time-to-first-batch set is {size} bytes, under {args.ttfb_gib} GiB")
            for scheme in ("s3", "gs"):
                upload(big, scheme, "big")
                point(proxies, scheme, 0.0)
                ranged = run_case("ar", f"{scheme}://{BUCKET}/big", names_big, 1024, 2048)
                first = download_first("ar", scheme, "big", names_big, 1024, 2048)
                ttfb.append({"storage": scheme, "bytes": size, "records": n, "ranged_ttfb_s": ranged["ttfb_s"],
                             "download_first_ttfb_s": first["ttfb_s"],
                             "ratio": first["ttfb_s"] / ranged["ttfb_s"]})
                print(json.dumps(ttfb[-1]), flush=True)
        for p in proxies.values():
            p.close()
        result = {"load_avg_1m_before": load, "load_avg_1m_after": os.getloadavg()[0],
                  "policy": storage.policy().__dict__, "upload_s": uploads,
                  "request_ceiling": ceiling, "rows": rows, "block_shuffle": blocks, "ttfb_1gib": ttfb,
                  "command": "flock /tmp/zephon-bench.lock .venv/bin/python benchmarks/storage.py"}
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))
        plot(result, args.out + ".png")
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    blocks = [r for r in result.get("block_shuffle", []) if "rows_per_s" in r]
    ax = axes[2]
    labels = [f"{r['format']} {r['storage']}\n{int(r['latency_ms'])} ms" for r in blocks]
    ax.bar(range(len(blocks)), [r["rows_per_s"] for r in blocks],
           color=["grey" if r["storage"].startswith("local") else "tab:green" for r in blocks])
    for i, r in enumerate(blocks):
        if "vs_local" in r:
            ax.text(i, r["rows_per_s"], f"{100 * r['vs_local']:.0f}%", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(blocks)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("rows/s (whole epoch, B = 1024)")
    ax.set_yscale("log")
    ax.set_title("block shuffle (default block, window = 2B blocks)")
    for ax, kind, title in zip(axes, ("ar", "pq"), ("ArrayRecord 256 x int32 (global shuffle)",
                                                   "Parquet text (global shuffle)")):
        rows = [r for r in result["rows"] if r["format"] == kind]
        labels = [f"{r['storage']}\n{int(r['latency_ms'])} ms B={r['batch']}" for r in rows]
        ax.bar(range(len(rows)), [r["rows_per_s"] for r in rows],
               color=["grey" if r["storage"] == "local" else "tab:orange" if "download" in r["storage"]
                      else "tab:blue" for r in rows])
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
        ax.set_ylabel("rows/s")
        ax.set_yscale("log")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""`zephon bench` (`make bench`): Zephon head to head with Grain and the raw read limits, one run.

What runs (every measurement in a fresh process, all cases repeated `--rounds` times,
interleaved, so machine noise hits every row alike; the table shows medians):

  ArrayRecord, global shuffle, batch 64 and 1024, the same records for everyone:
    zephon inline | threads | processes      Loader(Source.shuffle.lanes(8).batch(B), ArrayRecordSource)
    grain map[i]                             MapDataset.source.shuffle.map(decode).batch, indexed
    grain map[i] batch-decode                ... .batch(batch_fn=<Zephon's decode>), indexed
    grain iter threads=16                    ... .map(decode).to_iter_dataset(ReadOptions(16)).batch
    grain iter batch-decode threads=4        ... .batch(batch_fn=...).to_iter_dataset(ReadOptions(4))
    grain mp_prefetch workers=N              the line above, .mp_prefetch(N workers)
    grain DataLoader workers=N               grain.DataLoader(IndexSampler(shuffle), [decode, Batch])
    raw read, groups of 1024                 ArrayRecordReader.read of the same shuffled indices,
                                             1,024 records a call, the same decode, nothing else
    raw read, one batch a call               the same, one batch's indices a call
    raw read, groups of 16384                the same, as many records a call as Zephon's
                                             read-ahead: the reader's own limit at that size
  Parquet (the same records, 4 files, row groups of 1,000, a fixed-size list column):
    zephon parquet inline | threads | processes   window-grouped reads (one decode per row group
                                                   per read-ahead window)
    zephon parquet, one batch a read          read_ahead = one batch: what grouping saves
    raw parquet, whole files                  pyarrow reading whole files into numpy (no shuffle)
  Filter (issue 11; its own report, filter.json / filter.png; `--only filter` runs just this):
    zephon filter inline | threads:2 | processes:2   the plan above + [Filter(keep_half, batched=True)],
                                              keeping ~50% (token 1, a hash of the id, even): the
                                              lane engine; rated in *input* records/s (emitted rows/s
                                              ÷ the exact keep fraction of the data set)
    zephon one-to-one inline | threads:2 | processes:2   the same plan without the filter
    grain filter <config>                     the same filter in every Grain configuration that
                                              has one (bench_filter.GRAIN_FILTER_CONFIGS)
    targets: filter best / one-to-one best >= 60%, filter best / Grain best >= 3x
  Scaling:
    plan memory                               peak RSS iterating a plan over 10**4 vs 10**9 records
    resume                                    time to the first batch at step 0, at start_step=10**6,
                                              and restoring a state saved at 10**6

Every loader streams reshuffled epochs endlessly; throughput is the steady rate over
`--max-seconds` after a warm-up (10% of an epoch or 2 s), so worker start-up and filling prefetch
buffers count for no loader (time to the first batch, start-up included, is reported separately,
and the JSON also holds the overall rate from construction on); memory is the peak PSS summed over
the case's process tree (so workers and shared memory count once), sampled every 200 ms.

Writes benchmarks/results/<name>.json and <name>.png and prints the table with ratios.

    zephon bench                          # the full run (~10-15 min on 2 cores)
    zephon bench --quick                  # 20k records, 1 round, 2 s per case
    python benchmarks/run.py --records 200000 --batches 64 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_filter  # noqa: E402
import data  # noqa: E402  (a sibling module, also imported by the case processes)

from zephon.exec.steps import READ_AHEAD_ROWS  # noqa: E402

GRAIN_CONFIGS = ["map[i]", "map[i] batch-decode", "iter threads=16", "iter batch-decode threads=4",
                 "mp_prefetch workers={w}", "DataLoader workers={w}"]
TARGETS = {"vs_grain": 3.0, "vs_ceiling": 0.60, "plan_rss_mb": 50.0, "resume_ratio": 2.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zephon bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=100_000, help="records in the data set")
    p.add_argument("--width", type=int, default=256, help="int32 tokens per record")
    p.add_argument("--shards", type=int, default=4, help="ArrayRecord shards")
    p.add_argument("--writer-options", default="group_size:1,uncompressed",
                   help="ArrayRecord writer options (default: one record per chunk for random "
                        "access, uncompressed, as the reference figures in DESIGN.md); "
                        "'group_size:1' gives ArrayRecord's default zstd compression")
    p.add_argument("--batches", default="64,1024", help="comma-separated global batch sizes")
    p.add_argument("--runners", default="inline,threads,processes", help="Zephon runners")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every case")
    p.add_argument("--max-seconds", type=float, default=4.0,
                   help="steady-state seconds measured per case, after warm-up")
    p.add_argument("--only", default="array_record,parquet,scaling,filter",
                   help="families to run: array_record, parquet, scaling, filter")
    p.add_argument("--filter-runners", default="inline,threads:2,processes:2",
                   help="Zephon runners of the filter family (filter and one-to-one rows)")
    p.add_argument("--filter-name", default="filter", help="results file stem of the filter family")
    p.add_argument("--quick", action="store_true", help="20k records, 1 round, 2 s a case")
    p.add_argument("--data-dir", default=str(HERE / "data"), help="where data sets are cached")
    p.add_argument("--out", default=str(HERE / "results"), help="results directory")
    p.add_argument("--name", default="bench", help="results file stem")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.records, args.rounds, args.max_seconds = min(args.records, 20_000), 1, 2.0
    return args


# --- cases --------------------------------------------------------------------------------------
def build_cases(args: argparse.Namespace, ds: data.DataSet, workers: int) -> list[dict[str, Any]]:
    only = set(args.only.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    ms = args.max_seconds
    cases: list[dict[str, Any]] = []

    def add(family: str, label: str, **spec: Any) -> None:
        cases.append({"family": family, "label": label, "batch": spec.get("batch"),
                      "spec": {"dataset": ds.to_json(), **spec}})

    for b in batches:
        if "array_record" in only:
            for r in runners:
                add("zephon", f"zephon {r}", kind="zephon", fmt="array_record", runner=r,
                    batch=b, max_seconds=ms)
            for g in GRAIN_CONFIGS:
                cfg = g.format(w=workers)
                add("grain", f"grain {cfg}", kind="grain", config=cfg, batch=b, max_seconds=ms,
                    workers=workers)
            add("raw", "raw read, groups of 1024", kind="raw_array_record", batch=b, group=1024,
                max_seconds=ms)
            add("raw", "raw read, one batch a call", kind="raw_array_record", batch=b, group=b,
                max_seconds=ms)
            add("raw", f"raw read, groups of {READ_AHEAD_ROWS}", kind="raw_array_record", batch=b,
                group=READ_AHEAD_ROWS, max_seconds=ms)
        if "parquet" in only:
            for r in runners:
                add("zephon-parquet", f"zephon parquet {r}", kind="zephon", fmt="parquet",
                    runner=r, batch=b, max_seconds=ms)
            add("zephon-parquet", "zephon parquet, one batch a read", kind="zephon", fmt="parquet",
                runner="inline", batch=b, max_seconds=min(ms, 2.0), read_ahead=b)
    if "parquet" in only:
        add("raw-parquet", "raw parquet, whole files", kind="raw_parquet", max_seconds=ms)
    if "filter" in only:
        for b in batches:
            for r in [r.strip() for r in args.filter_runners.split(",") if r.strip()]:
                add("filter-zephon", f"zephon filter {r}", kind="zephon_filter", runner=r, batch=b,
                    max_seconds=ms)
                add("filter-one-to-one", f"zephon one-to-one {r}", kind="zephon_one_to_one",
                    runner=r, batch=b, max_seconds=ms)
            for g in bench_filter.GRAIN_FILTER_CONFIGS:
                cfg = g.format(w=workers)
                add("filter-grain", f"grain filter {cfg}", kind="grain_filter", config=cfg, batch=b,
                    max_seconds=ms, workers=workers)
    if "scaling" in only:
        for size in (10**4, 10**9):
            add("scaling", f"plan memory, {size:.0e} records", kind="plan_memory", size=size,
                steps=200, batch=1024)
        for r in ("inline", "processes"):
            add("scaling", f"resume {r}", kind="resume", batch=64, far=10**6, trials=7, runner=r)
    return cases


# --- running one case ---------------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_case(case: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs one case in a fresh interpreter, sampling its process tree's memory."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import cases; cases.child_main()")
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(case["spec"])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], sum(_pss_kb(p) for p in _tree(proc.pid)))
            time.sleep(0.2)  # reading smaps costs CPU the measured case would miss

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in reversed(_tree(proc.pid)):
            try:
                os.kill(p, 9)
            except OSError:
                pass
        out, err = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "stderr": err[-2000:]}
    sampler.join()
    line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": f"exit code {proc.returncode}", "stderr": err[-3000:]}
    result = json.loads(line[len("RESULT "):])
    result["peak_pss_mb"] = peak[0] / 1024
    return result


# --- summary --------------------------------------------------------------------------------------
def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r and r[key] is not None]
    return statistics.median(vals) if vals else None


def summarise(cases: list[dict[str, Any]], runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = []
    for i, c in enumerate(cases):
        ok = [r for r in runs[i] if "error" not in r]
        row = {"family": c["family"], "label": c["label"], "batch": c["batch"],
               "runs": len(runs[i]), "errors": [r["error"] for r in runs[i] if "error" in r]}
        for key in ("samples_per_s", "overall_samples_per_s", "first_batch_s", "peak_pss_mb", "ru_maxrss_mb"):
            row[key] = _median(ok, key)
        if c["spec"]["kind"] == "resume":
            for key in ok[0] if ok else ():
                if key.startswith(("step 0", "start_step", "restore")):
                    row[key] = _median(ok, key)
        rows.append(row)

    def best(family: str, batch: int) -> dict[str, Any] | None:
        cands = [r for r in rows if r["family"] == family and r["batch"] == batch and r["samples_per_s"]
                 and "one batch" not in r["label"]]
        return max(cands, key=lambda r: r["samples_per_s"]) if cands else None

    def find(label: str, batch: int | None) -> dict[str, Any] | None:
        return next((r for r in rows if r["label"] == label and r["batch"] == batch), None)

    ratios: dict[str, Any] = {}
    for batch in sorted({r["batch"] for r in rows if r["family"] in ("zephon", "zephon-parquet")}):
        z, g = best("zephon", batch), best("grain", batch)
        ceil = find("raw read, groups of 1024", batch)
        zp, pceil = best("zephon-parquet", batch), find("raw parquet, whole files", None)
        entry: dict[str, Any] = {}
        if z and g:
            entry["zephon_best"] = (z["label"], z["samples_per_s"])
            entry["grain_best"] = (g["label"], g["samples_per_s"])
            entry["zephon_vs_grain"] = z["samples_per_s"] / g["samples_per_s"]
        if z and ceil and ceil["samples_per_s"]:
            entry["raw_ceiling"] = ceil["samples_per_s"]
            entry["zephon_vs_ceiling"] = z["samples_per_s"] / ceil["samples_per_s"]
        same = find(f"raw read, groups of {READ_AHEAD_ROWS}", batch)
        if z and same and same["samples_per_s"]:
            entry["raw_same_read_size"] = same["samples_per_s"]
            entry["zephon_vs_same_read_size"] = z["samples_per_s"] / same["samples_per_s"]
        if zp and g:
            entry["zephon_parquet_best"] = (zp["label"], zp["samples_per_s"])
            entry["parquet_vs_grain"] = zp["samples_per_s"] / g["samples_per_s"]
        if zp and pceil and pceil["samples_per_s"]:
            entry["parquet_ceiling"] = pceil["samples_per_s"]
            entry["parquet_vs_parquet_ceiling"] = zp["samples_per_s"] / pceil["samples_per_s"]
        ratios[str(batch)] = entry
    small, big = find("plan memory, 1e+04 records", 1024), find("plan memory, 1e+09 records", 1024)
    if small and big and small["ru_maxrss_mb"] and big["ru_maxrss_mb"]:
        ratios["plan_memory"] = {"rss_1e4_mb": small["ru_maxrss_mb"], "rss_1e9_mb": big["ru_maxrss_mb"],
                                 "delta_mb": big["ru_maxrss_mb"] - small["ru_maxrss_mb"]}
    for r in rows:
        if r["label"].startswith("resume") and r.get("step 0"):
            far = {k: v for k, v in r.items() if k.startswith(("start_step", "restore"))}
            ratios[r["label"]] = {"step 0 s": r["step 0"], **{f"{k} s": v for k, v in far.items()},
                                  **{f"{k} / step 0": v / r["step 0"] for k, v in far.items()}}
    return {"rows": rows, "ratios": ratios}


def check_targets(ratios: dict[str, Any]) -> list[tuple[str, str, bool]]:
    out = []
    for batch, e in ratios.items():
        if not batch.isdigit():
            continue
        if "zephon_vs_grain" in e:
            out.append((f"B={batch}: Zephon best / Grain best (ArrayRecord) >= 3x",
                        f"{e['zephon_vs_grain']:.2f}x", e["zephon_vs_grain"] >= TARGETS["vs_grain"]))
        if "zephon_vs_ceiling" in e:
            out.append((f"B={batch}: Zephon best / raw ceiling (1024-record reads) >= 60%",
                        f"{100 * e['zephon_vs_ceiling']:.0f}%", e["zephon_vs_ceiling"] >= TARGETS["vs_ceiling"]))
        if "parquet_vs_grain" in e:
            out.append((f"B={batch}: Zephon Parquet best / Grain best (ArrayRecord) >= 3x",
                        f"{e['parquet_vs_grain']:.2f}x", e["parquet_vs_grain"] >= TARGETS["vs_grain"]))
    pm = ratios.get("plan_memory")
    if pm:
        out.append(("peak RSS, plan over 1e9 records - over 1e4 <= 50 MB", f"{pm['delta_mb']:+.1f} MB",
                    pm["delta_mb"] <= TARGETS["plan_rss_mb"]))
    for label, e in ratios.items():
        if label.startswith("resume"):
            for k, v in e.items():
                if k.endswith("/ step 0"):
                    out.append((f"{label}: first batch at {k} <= 2x", f"{v:.2f}x", v <= TARGETS["resume_ratio"]))
    return out


# --- output ---------------------------------------------------------------------------------------
def _fmt_rate(x: float | None) -> str:
    return "-" if not x else f"{x / 1000:,.1f}k"


def table(summary: dict[str, Any], batches: list[int]) -> str:
    rows = summary["rows"]
    labels = list(dict.fromkeys(r["label"] for r in rows if r["family"] != "scaling"))
    by = {(r["label"], r["batch"]): r for r in rows}
    head = f"{'case':44s}" + "".join(f"{'B=' + str(b) + ' samples/s':>18s}" for b in batches) + \
        f"{'first batch':>13s}{'peak PSS':>10s}"
    lines = [head, "-" * len(head)]
    for label in labels:
        cells = []
        rs = [by.get((label, b)) or by.get((label, None)) for b in batches]
        for r in rs:
            cells.append(f"{_fmt_rate(r['samples_per_s']) if r else '-':>18s}")
        anyr = next((r for r in rs if r), None)
        first = f"{anyr['first_batch_s'] * 1000:.0f} ms" if anyr and anyr.get("first_batch_s") else "-"
        pss = f"{anyr['peak_pss_mb']:.0f} MB" if anyr and anyr.get("peak_pss_mb") else "-"
        err = f"   ERROR: {anyr['errors'][0]}" if anyr and anyr["errors"] else ""
        lines.append(f"{label:44s}" + "".join(cells) + f"{first:>13s}{pss:>10s}{err}")
    lines.append("")
    for batch, e in summary["ratios"].items():
        if batch.isdigit():
            parts = []
            if "zephon_vs_grain" in e:
                parts.append(f"Zephon best ({e['zephon_best'][0]}) / Grain best ({e['grain_best'][0]}) = "
                             f"{e['zephon_vs_grain']:.2f}x")
            if "zephon_vs_ceiling" in e:
                parts.append(f"of raw ceiling = {100 * e['zephon_vs_ceiling']:.0f}%")
            if "zephon_vs_same_read_size" in e:
                parts.append(f"of raw reads at its own read size ({READ_AHEAD_ROWS}) = "
                             f"{100 * e['zephon_vs_same_read_size']:.0f}%")
            if "parquet_vs_grain" in e:
                parts.append(f"Parquet best / Grain best = {e['parquet_vs_grain']:.2f}x")
            if "parquet_vs_parquet_ceiling" in e:
                parts.append(f"Parquet best / Parquet ceiling = {100 * e['parquet_vs_parquet_ceiling']:.0f}%")
            lines.append(f"B={batch}: " + "; ".join(parts))
    pm = summary["ratios"].get("plan_memory")
    if pm:
        lines.append(f"plan memory: peak RSS {pm['rss_1e4_mb']:.0f} MB (1e4 records) vs "
                     f"{pm['rss_1e9_mb']:.0f} MB (1e9 records): {pm['delta_mb']:+.1f} MB")
    for label, e in summary["ratios"].items():
        if label.startswith("resume"):
            lines.append(f"{label}: " + ", ".join(
                f"{k} {v * 1000:.1f} ms" if k.endswith(" s") else f"{k} {v:.2f}x" for k, v in e.items()))
    return "\n".join(lines)


def plot(summary: dict[str, Any], batches: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"zephon": "#1f77b4", "zephon-parquet": "#6baed6", "grain": "#ff7f0e", "raw": "#7f7f7f",
              "raw-parquet": "#bdbdbd"}
    rows = [r for r in summary["rows"] if r["family"] in colors and r["samples_per_s"]]
    fig, axes = plt.subplots(1, len(batches), figsize=(7 * len(batches), 0.38 * len(rows) / max(1, len(batches)) + 2.5),
                             squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = [r for r in rows if r["batch"] in (b, None)]
        y = range(len(rs))
        ax.barh(list(y), [r["samples_per_s"] / 1000 for r in rs], color=[colors[r["family"]] for r in rs])
        ax.set_yticks(list(y), [r["label"] for r in rs], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("thousand samples / s (log scale)")
        ax.set_title(f"global batch {b}")
        for yi, r in zip(y, rs):
            ax.text(r["samples_per_s"] / 1000, yi, f" {r['samples_per_s'] / 1000:.0f}k", va="center", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment(argv: list[str]) -> dict[str, Any]:
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "-"

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=HERE.parent, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    import zephon

    # a frozen copy (`git archive HEAD`, commit in .git_commit, run with PYTHONPATH=<copy>) measures
    # one version of the code while others keep committing to the checkout
    stamp = HERE.parent / ".git_commit"
    snapshot = stamp.read_text().strip() if stamp.exists() and not (HERE.parent / ".git").exists() else ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    else:
        cpu = platform.processor()
    return {"command": ("zephon bench " + shlex.join(argv)).strip(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0)), "cpu": cpu,
            "versions": {p: version(p) for p in ("numpy", "grain", "array-record", "pyarrow")},
            "zephon_diff_sha1": hashlib.sha1(git("diff", "HEAD", "--", "zephon").encode()).hexdigest()[:12],
            "git_commit": git("rev-parse", "--short", "HEAD") or snapshot, "snapshot": bool(snapshot),
            "zephon_path": str(Path(zephon.__file__).parent),
            "git_dirty": bool(git("status", "--porcelain", "zephon", "benchmarks"))}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # `zephon bench -- --help` reaches us with the separator
        argv = argv[1:]
    args = parse_args(argv)
    from tqdm import tqdm

    workers = len(os.sched_getaffinity(0))
    env = environment(argv)
    env["load_avg_start"] = os.getloadavg()
    ds = data.prepare(args.data_dir, args.records, args.width, args.shards, args.writer_options, log=print)
    cases = build_cases(args, ds, workers)
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(cases))}
    timeout = max(120.0, 10 * args.max_seconds)
    with tqdm(total=len(cases) * args.rounds, desc="zephon bench", unit="case") as bar:
        for rnd in range(args.rounds):
            for i, case in enumerate(cases):
                bar.set_postfix_str(f"round {rnd + 1}: {case['label']}"
                                    + (f" B={case['batch']}" if case["batch"] else ""))
                result = run_case(case, timeout)
                result["round"] = rnd
                runs[i].append(result)
                if "error" in result:
                    tqdm.write(f"ERROR in {case['label']} B={case['batch']}: {result['error']}\n"
                               f"{result.get('stderr', '')}")
                bar.update()
    env["load_avg_end"] = os.getloadavg()
    end = environment(argv)
    env["git_commit_end"], env["git_dirty_end"] = end["git_commit"], end["git_dirty"]
    env["zephon_diff_sha1_end"] = end["zephon_diff_sha1"]
    if (env["git_commit_end"], env["zephon_diff_sha1_end"]) != (env["git_commit"], env["zephon_diff_sha1"]):
        print(f"WARNING: zephon/ changed during the run (HEAD {env['git_commit']} -> {env['git_commit_end']}, "
              f"uncommitted diff {env['zephon_diff_sha1']} -> {env['zephon_diff_sha1_end']}): cases may "
              "have measured different code; run again on a quiet checkout.")
    batches = [int(b) for b in args.batches.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    head = (f"{env['command']}  ({ds.records} records x {ds.width} int32, {ds.shards} shards, "
            f"writer '{ds.writer_options}', {env['cpus']} CPUs, {args.rounds} rounds, medians; "
            f"load avg {env['load_avg_start'][0]:.1f} -> {env['load_avg_end'][0]:.1f})")
    title = f"{env['command']} — {ds.records} records x {ds.width} int32, {env['cpus']} CPUs, medians of {args.rounds}"
    ok = True
    # the head-to-head families -> <name>.json/png; the filter family -> <filter-name>.json/png
    parts = [(args.name, [i for i, c in enumerate(cases) if c["family"] not in bench_filter.FAMILIES],
              summarise, check_targets, table, plot),
             (args.filter_name, [i for i, c in enumerate(cases) if c["family"] in bench_filter.FAMILIES],
              bench_filter.summarise, bench_filter.check_targets, bench_filter.table, bench_filter.plot)]
    for name, idx, summ, targ, tab, plt_ in parts:
        if not idx:
            continue  # a family not run leaves its earlier results alone
        sub_cases = [cases[i] for i in idx]
        sub_runs = {k: runs[i] for k, i in enumerate(idx)}
        summary = summ(sub_cases, sub_runs)
        targets = targ(summary["ratios"])
        report = {"environment": env, "dataset": ds.to_json(), "args": vars(args), **summary,
                  "targets": [{"target": t, "measured": m, "met": met} for t, m, met in targets],
                  "cases": [{**c, "spec": {k: v for k, v in c["spec"].items() if k != "dataset"},
                             "measurements": sub_runs[k]} for k, c in enumerate(sub_cases)]}
        (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
        print()
        print(head)
        print(tab(summary, batches))
        print()
        for t, m, met in targets:
            print(f"  [{'met' if met else 'MISSED'}] {t}: {m}")
        if not args.no_plot:
            plt_(summary, batches, out_dir / f"{name}.png", title)
        print(f"\nresults: {out_dir / (name + '.json')}" + ("" if args.no_plot else f", {out_dir / (name + '.png')}"))
        ok = ok and all(not r["errors"] for r in summary["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

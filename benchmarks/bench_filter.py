"""The filter benchmark of issue 11: a pipeline that keeps about half of its records.

On the benchmark's ArrayRecord data (`data.py`), globally shuffled, reshuffled every epoch,
batches of 64 and 1024 (8 lanes, as the other cases):

  zephon filter inline | threads:2 | processes:2
      Loader(Source.shuffle.repeat.lanes(8).batch(B), ArrayRecordSource,
             [Filter(keep_half, batched=True)]): the lane engine
  zephon one-to-one inline | threads:2 | processes:2
      the same plan and source without the filter: the random-access path, the reference
  grain <config>
      MapDataset.source(ArrayRecordDataSource).shuffle.repeat ... filter ... batch, in every
      configuration Grain has for a filter (see `GRAIN_FILTER_CONFIGS`); the best is the row
      Zephon is compared with

The predicate keeps a record when token 1 (a splitmix64 hash of the record id, see
`data.record_tokens`) is even. Over an epoch it keeps exactly `keep_fraction(records)` of the
records (computed from the data's content rule, and re-checked against the rows every case
emits). The figure of merit is *input* records/s: records read and filtered per second =
emitted rows/s ÷ keep fraction. For the one-to-one rows input = output. Zephon filter cases also
report the inputs their lanes actually consumed (from the lane cursors) over the whole run, as
a check of that conversion.

Everything a worker process unpickles (the predicate) is defined here at module level; nothing
here imports Grain (its pieces live in `grain_ops.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from data import DataSet, record_tokens

SEED = 0
LANES = 8
#: The token whose parity decides: column 1 is a splitmix64 hash of the record id.
HASH_COLUMN = 1


# --- the predicate ------------------------------------------------------------------------------
def keep_half(cols: dict[str, np.ndarray]) -> np.ndarray:
    """Batched filter: keep a record when its hash token is even (about half of them)."""
    return (cols["tokens"][:, HASH_COLUMN] & 1) == 0


def keep_mask_of_ids(ids: np.ndarray) -> np.ndarray:
    """The predicate by record id, from the data's content rule (no read)."""
    return (record_tokens(np.asarray(ids, np.int64), HASH_COLUMN + 1)[:, HASH_COLUMN] & 1) == 0


def keep_fraction(records: int) -> float:
    """The exact fraction of the data set's records the filter keeps (so of every epoch)."""
    return float(keep_mask_of_ids(np.arange(records)).mean())


def check_filtered(tokens: np.ndarray, width: int) -> None:
    """Rows are intact records, and every one passes the predicate."""
    tokens = np.asarray(tokens)
    if tokens.shape[1:] != (width,) or not np.array_equal(tokens, record_tokens(tokens[:, 0], width)):
        raise AssertionError(f"batch content is wrong (shape {tokens.shape})")
    if not np.all(keep_half({"tokens": tokens})):
        raise AssertionError("a row that the filter drops was emitted")


# --- timing ---------------------------------------------------------------------------------------
def consume(make: Callable[[], Iterator[Any]], rows: Callable[[Any], int], epoch_rows: int,
            max_seconds: float, check: Callable[[Any], None], finish: Callable[[Any], dict] | None = None
            ) -> dict[str, Any]:
    """`cases.consume`, counting emitted rows: steady rate over `max_seconds` after a warm-up of
    10% of an epoch's output or 2 s past the first batch. `finish(iterator)` adds fields."""
    import time

    t0 = time.perf_counter()
    it = make()
    first = next(it)
    t1 = time.perf_counter()
    check(first)
    done, last = rows(first), first
    t_warm, warm_done = None, 0
    for last in it:
        done += rows(last)
        now = time.perf_counter()
        if t_warm is None and (done >= epoch_rows // 10 or now - t1 >= 2.0):
            t_warm, warm_done = now, done
        elif t_warm is not None and now - t_warm >= max_seconds:
            break
    t2 = time.perf_counter()
    check(last)
    extra = finish(it) if finish is not None else {}
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return {"first_batch_s": t1 - t0, "samples": done, "seconds": t2 - t0,
            "overall_samples_per_s": done / (t2 - t0), "steady_samples": done - warm_done,
            "steady_seconds": t2 - t_warm, "samples_per_s": (done - warm_done) / (t2 - t_warm), **extra}


def _as_input_rate(out: dict[str, Any], keep: float) -> dict[str, Any]:
    """Adds the input-record rates (emitted ÷ keep fraction)."""
    out["keep_fraction"] = keep
    out["output_samples_per_s"] = out["samples_per_s"]
    out["input_records_per_s"] = out["samples_per_s"] / keep
    out["overall_input_records_per_s"] = out["overall_samples_per_s"] / keep
    return out


# --- Zephon -------------------------------------------------------------------------------------
def _zephon(ds: DataSet, batch: int) -> tuple[Any, Any]:
    from zephon import Source
    from zephon.sources import ArrayRecordSource, FixedFields

    src = ArrayRecordSource(ds.array_record_paths, FixedFields({"tokens": ("int32", (ds.width,))}))
    plan = Source(len(src)).shuffle(SEED).repeat().lanes(LANES).batch(batch)
    return src, plan


def expected_first_batch(plan: Any, batch: int) -> np.ndarray:
    """Record ids of global batch 0 of the filtered plan: each lane's stream, filtered, first
    B/L survivors, lane-major (computed from the plan's algebra, without the engine)."""
    per = plan.per_lane
    look = 8 * per + 64
    out = []
    for lane in range(plan.lanes.count):
        ids = plan.lanes.resolve_lanes(np.full(look, lane, np.int64), np.arange(look, dtype=np.int64)).record
        kept = ids[keep_mask_of_ids(ids)]
        out.append(kept[:per])
    return np.concatenate(out)


def case_zephon_filter(ds: DataSet, runner: str, batch: int, max_seconds: float) -> dict[str, Any]:
    from zephon import Filter, How, Loader, Pipeline
    from zephon.runners import from_spec

    src, plan = _zephon(ds, batch)
    keep = keep_fraction(ds.records)
    want = expected_first_batch(plan, batch)
    op = Filter(keep_half, batched=True, name="bench.keep_half", version=1)

    def check(b: Any) -> None:
        check_filtered(b.data["tokens"], ds.width)
        if not np.array_equal(b.data["tokens"][:, 0], b.refs.record):
            raise AssertionError(f"step {b.step}: rows do not hold the records their refs name")
        if b.step == 0 and not np.array_equal(b.data["tokens"][:, 0], want):
            raise AssertionError("step 0 does not hold the first surviving records of every lane")

    def finish(loader: Any) -> dict[str, Any]:
        lanes = loader.position()["lanes"]
        inputs = sum(s["cursor"][0] for s in lanes.values())
        return {"inputs_consumed": inputs, "steps": loader.step,
                "observed_keep": loader.step * batch / inputs if inputs else None}

    def make() -> Iterator[Any]:
        return Loader(Pipeline(plan, src, [op]), how=How(runner=from_spec(runner)))

    return _as_input_rate(consume(make, lambda b: len(b.data["tokens"]), int(ds.records * keep),
                                  max_seconds, check, finish), keep)


def case_zephon_one_to_one(ds: DataSet, runner: str, batch: int, max_seconds: float) -> dict[str, Any]:
    from zephon import How, Loader, Pipeline
    from zephon.runners import from_spec

    src, plan = _zephon(ds, batch)

    def check(b: Any) -> None:
        tokens = b.data["tokens"]
        if not np.array_equal(tokens, record_tokens(tokens[:, 0], ds.width)):
            raise AssertionError("batch content is wrong")
        if not np.array_equal(tokens[:, 0], plan.refs(b.step).record):
            raise AssertionError(f"step {b.step} does not hold the plan's records")

    def make() -> Iterator[Any]:
        return Loader(Pipeline(plan, src), how=How(runner=from_spec(runner)))

    return _as_input_rate(consume(make, lambda b: len(b.data["tokens"]), ds.records, max_seconds,
                                  check), 1.0)


# --- Grain --------------------------------------------------------------------------------------
#: Every way we found to run this filter in Grain 0.2, each measured; the fastest is Grain's row.
#: (`MapDataset.batch` cannot follow `MapDataset.filter`, so all go through `to_iter_dataset`.)
#: {w} = worker processes. "per-record": map(decode).filter(pred) then .batch; "bytes-filter":
#: the predicate on the raw bytes (token 1's low byte), decode once a batch (batch_fn);
#: "batched-filter": MapDataset.batch(GRAIN_CHUNK, batch_fn=decode + vectorised predicate)
#: then RebatchIterDataset(B) — Zephon's batched Filter written in Grain.
GRAIN_FILTER_CONFIGS = [
    "iter per-record threads=16",              # Grain's default ReadOptions
    "iter per-record threads=0",
    "iter bytes-filter threads=0",
    "iter batched-filter threads=0",
    "iter batched-filter threads=2",
    "mp_prefetch bytes-filter workers={w}",
    "mp_prefetch batched-filter workers={w}",
    "DataLoader workers={w}",                  # grain.DataLoader([decode, Filter, Batch])
]
#: Records a chunk in the batched-filter configurations (1024 measured a little ahead of 256).
GRAIN_CHUNK = 1024


def case_grain_filter(ds: DataSet, config: str, batch: int, max_seconds: float, workers: int) -> dict[str, Any]:
    import grain
    from grain_ops import DecodeRecord, KeepHalf, KeepHalfBytes, decode_batch, decode_filter_batch

    keep = keep_fraction(ds.records)
    source = grain.sources.ArrayRecordDataSource(ds.array_record_paths)
    base = grain.MapDataset.source(source).shuffle(seed=SEED).repeat()  # reshuffled epochs

    def options(threads: int) -> Any:
        return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=500 if threads >= 16 else
                                 max(1, 64 * threads))

    def per_record(threads: int) -> Any:
        return (base.map(DecodeRecord()).filter(KeepHalf()).to_iter_dataset(options(threads))
                .batch(batch, drop_remainder=True))

    def bytes_filter(threads: int) -> Any:
        return (base.filter(KeepHalfBytes()).to_iter_dataset(options(threads))
                .batch(batch, drop_remainder=True, batch_fn=decode_batch))

    def batched_filter(threads: int) -> Any:
        chunks = base.batch(GRAIN_CHUNK, drop_remainder=True, batch_fn=decode_filter_batch)
        it = chunks.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(1, 2 * threads)))
        return grain.experimental.RebatchIterDataset(it, batch, drop_remainder=True)

    mp = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=4)
    builders = {"iter per-record threads=16": lambda: per_record(16),
                "iter per-record threads=0": lambda: per_record(0),
                "iter bytes-filter threads=0": lambda: bytes_filter(0),
                "iter batched-filter threads=0": lambda: batched_filter(0),
                "iter batched-filter threads=2": lambda: batched_filter(2),
                f"mp_prefetch bytes-filter workers={workers}": lambda: bytes_filter(0).mp_prefetch(mp),
                f"mp_prefetch batched-filter workers={workers}": lambda: batched_filter(0).mp_prefetch(mp)}
    if config in builders:
        make = lambda: iter(builders[config]())
    elif config == f"DataLoader workers={workers}":
        sampler = grain.samplers.IndexSampler(len(source), shuffle=True, seed=SEED, num_epochs=None,
                                              shard_options=grain.sharding.NoSharding())
        make = lambda: iter(grain.DataLoader(
            data_source=source, sampler=sampler, worker_count=workers, worker_buffer_size=4,
            operations=[DecodeRecord(), KeepHalf(), grain.transforms.Batch(batch, drop_remainder=True)]))
    else:
        raise ValueError(f"unknown grain filter config {config!r}")

    def check(b: Any) -> None:
        b = np.asarray(b)
        if len(b) != batch:
            raise AssertionError(f"batch of {len(b)} rows, expected {batch}")
        check_filtered(b, ds.width)

    return _as_input_rate(consume(make, len, int(ds.records * keep), max_seconds, check), keep)


CASES = {"zephon_filter": case_zephon_filter, "zephon_one_to_one": case_zephon_one_to_one,
         "grain_filter": case_grain_filter}


# --- report (called by run.py) --------------------------------------------------------------------
FAMILIES = ("filter-zephon", "filter-one-to-one", "filter-grain")
TARGETS = {"filter_vs_one_to_one": 0.60, "filter_vs_grain": 3.0}
_KEYS = ("input_records_per_s", "samples_per_s", "overall_input_records_per_s", "first_batch_s",
         "peak_pss_mb", "observed_keep", "keep_fraction")


def _median(vals: list[float]) -> float | None:
    import statistics

    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def summarise(cases: list[dict[str, Any]], runs: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per case over rounds, and per batch size the ratios issue 11 asks for."""
    rows = []
    for i, c in enumerate(cases):
        if c["family"] not in FAMILIES:
            continue
        ok = [r for r in runs[i] if "error" not in r]
        row = {"family": c["family"], "label": c["label"], "batch": c["batch"],
               "runner": c["spec"].get("runner"), "runs": len(runs[i]),
               "errors": [r["error"] for r in runs[i] if "error" in r]}
        for key in _KEYS:
            row[key] = _median([r.get(key) for r in ok])
        row["input_records_per_s_all"] = [r.get("input_records_per_s") for r in ok]
        rows.append(row)

    def best(family: str, batch: int) -> dict[str, Any] | None:
        cands = [r for r in rows if r["family"] == family and r["batch"] == batch and r["input_records_per_s"]]
        return max(cands, key=lambda r: r["input_records_per_s"]) if cands else None

    ratios: dict[str, Any] = {}
    for batch in sorted({r["batch"] for r in rows}):
        f, o, g = best("filter-zephon", batch), best("filter-one-to-one", batch), best("filter-grain", batch)
        e: dict[str, Any] = {}
        if f:
            e["filter_best"] = (f["label"], f["input_records_per_s"])
            e["keep_fraction"] = f["keep_fraction"]
        if o:
            e["one_to_one_best"] = (o["label"], o["input_records_per_s"])
        if g:
            e["grain_best"] = (g["label"], g["input_records_per_s"])
        if f and o:
            e["filter_vs_one_to_one"] = f["input_records_per_s"] / o["input_records_per_s"]
        if f and g:
            e["filter_vs_grain"] = f["input_records_per_s"] / g["input_records_per_s"]
        per_runner = {}
        for r in rows:
            if r["family"] == "filter-zephon" and r["batch"] == batch and r["input_records_per_s"]:
                same = next((x for x in rows if x["family"] == "filter-one-to-one" and x["batch"] == batch
                             and x["runner"] == r["runner"] and x["input_records_per_s"]), None)
                if same:
                    per_runner[r["runner"]] = r["input_records_per_s"] / same["input_records_per_s"]
        e["filter_vs_one_to_one_same_runner"] = per_runner
        ratios[str(batch)] = e
    return {"rows": rows, "ratios": ratios}


def check_targets(ratios: dict[str, Any]) -> list[tuple[str, str, bool]]:
    out = []
    for batch, e in ratios.items():
        if "filter_vs_one_to_one" in e:
            out.append((f"B={batch}: filter best runner / one-to-one best, input records/s >= 60%",
                        f"{100 * e['filter_vs_one_to_one']:.0f}%",
                        e["filter_vs_one_to_one"] >= TARGETS["filter_vs_one_to_one"]))
        if "filter_vs_grain" in e:
            out.append((f"B={batch}: filter best runner / Grain best filter, input records/s >= 3x",
                        f"{e['filter_vs_grain']:.2f}x", e["filter_vs_grain"] >= TARGETS["filter_vs_grain"]))
    return out


def _k(x: float | None) -> str:
    return "-" if not x else f"{x / 1000:,.1f}k"


def table(summary: dict[str, Any], batches: list[int]) -> str:
    rows = summary["rows"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["label"], r["batch"]): r for r in rows}
    head = f"{'filter case':46s}" + "".join(f"{'B=' + str(b) + ' input rec/s':>20s}" for b in batches) + \
        "".join(f"{'B=' + str(b) + ' rows/s':>15s}" for b in batches) + f"{'first batch':>13s}{'peak PSS':>10s}"
    lines = [head, "-" * len(head)]
    for label in labels:
        rs = [by.get((label, b)) for b in batches]
        anyr = next((r for r in rs if r), None)
        first = f"{anyr['first_batch_s'] * 1000:.0f} ms" if anyr and anyr.get("first_batch_s") else "-"
        pss = f"{anyr['peak_pss_mb']:.0f} MB" if anyr and anyr.get("peak_pss_mb") else "-"
        err = f"   ERROR: {anyr['errors'][0]}" if anyr and anyr["errors"] else ""
        lines.append(f"{label:46s}" + "".join(f"{_k(r['input_records_per_s']) if r else '-':>20s}" for r in rs)
                     + "".join(f"{_k(r['samples_per_s']) if r else '-':>15s}" for r in rs)
                     + f"{first:>13s}{pss:>10s}{err}")
    lines.append("")
    for batch, e in summary["ratios"].items():
        parts = []
        if "keep_fraction" in e:
            parts.append(f"keep fraction {e['keep_fraction']:.4f}")
        if "filter_vs_one_to_one" in e:
            parts.append(f"filter best ({e['filter_best'][0]}) / one-to-one best ({e['one_to_one_best'][0]}) = "
                         f"{100 * e['filter_vs_one_to_one']:.0f}%")
        if e.get("filter_vs_one_to_one_same_runner"):
            parts.append("same runner: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in
                                                     e["filter_vs_one_to_one_same_runner"].items()))
        if "filter_vs_grain" in e:
            parts.append(f"filter best / Grain best ({e['grain_best'][0]}) = {e['filter_vs_grain']:.2f}x")
        lines.append(f"B={batch}: " + "; ".join(parts))
    return "\n".join(lines)


def plot(summary: dict[str, Any], batches: list[int], path: Any, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"filter-zephon": "#1f77b4", "filter-one-to-one": "#9ecae1", "filter-grain": "#ff7f0e"}
    rows = [r for r in summary["rows"] if r["input_records_per_s"]]
    per = max(1, len(rows) // max(1, len(batches)))
    fig, axes = plt.subplots(1, len(batches), figsize=(7.5 * len(batches), 0.4 * per + 2.6), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = [r for r in rows if r["batch"] == b]
        y = list(range(len(rs)))
        vals = [r["input_records_per_s"] / 1000 for r in rs]
        ax.barh(y, vals, color=[colors[r["family"]] for r in rs])
        ax.set_yticks(y, [r["label"] for r in rs], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("thousand input records / s (read and filtered; log scale)")
        e = summary["ratios"].get(str(b), {})
        sub = []
        if "filter_vs_one_to_one" in e:
            sub.append(f"filter / one-to-one {100 * e['filter_vs_one_to_one']:.0f}%")
        if "filter_vs_grain" in e:
            sub.append(f"filter / Grain {e['filter_vs_grain']:.1f}x")
        ax.set_title(f"global batch {b}" + (": " + ", ".join(sub) if sub else ""), fontsize=10)
        for yi, v in zip(y, vals):
            ax.text(v, yi, f" {v:.0f}k", va="center", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

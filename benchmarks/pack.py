"""Tokenize + pack, head to head: Zephon vs Grain's own packers vs the tokenizer's ceiling.

Issue 12 ("LM pretraining pipelines") asks for tokens/s, padding and tokens lost of online
tokenize+pack at seq_len 512 and 2048, batch 32, on generated text, with everyone on the same
texts and the same tokenizer, in one run:

  encode_batch   `Tokenizer.encode_batch` over the texts in chunks of 1024, best of a few
                 repeats, in this process (Rust threads on every core): the reference the
                 issue's targets are ratios of (mode "ceiling"). It is not a hard bound: its
                 Python side (one Encoding object and one ids list per text) runs on one core,
                 so pipelines tokenizing in several processes can exceed it.
  grain          `MapDataset.source(texts).repeat().map(tokenize)` -> `to_iter_dataset` ->
                 `ConcatThenSplitIterDataset` | `FirstFitPackIterDataset` |
                 `BestFitPackIterDataset` -> `.batch(32)`, each in every configuration below;
                 the fastest per mode and seq_len is the row in pack.json:
                   iter threads=0                  plain iteration, ReadOptions(num_threads=0)
                   iter threads=16                 Grain's default ReadOptions (16 threads);
                                                   only with --grain-runners all: it ran at
                                                   about half of threads=0 in every mode
                   mp_prefetch workers=2           the pipeline in 2 processes, threads=0
                   batch-encode ...                tokenizing with encode_batch over 256 texts
                                                   (`.batch(256).map(encode_batch)` + FlatMap to
                                                   unbatch) instead of one text per `.map` call:
                                                   what a performance-minded Grain user writes;
                                                   without mp_prefetch only with --grain-runners
                                                   all
                   pretoken-cache ...              a reference, not a Grain configuration:
                                                   one text per `.map` call through Zephon's
                                                   exact pre-token cache (the ids Zephon's
                                                   Tokenize computes by default), so the two
                                                   pipelines compare on equal tokenizing cost
                 First-/best-fit raise on a document longer than seq_len, so their tokenize map
                 truncates (users must): `tokens_lost` is the fraction of all tokens cut off.
                 Concat-then-split splits documents and loses nothing.
  zephon         from a hook (below), when the Zephon operators exist; otherwise skipped. Its
                 `Tokenize` uses the pre-token cache by default; runner "... cache=0" is the
                 reference without it (the tokenizer's own encode_batch, as Grain has).

References (runners with "cache") are measured and drawn (hatched) but never picked as a row of
pack.json: Grain's rows are Grain's own configurations, Zephon's rows Zephon's defaults.

Rates are steady state: after the first batch and a warm-up (worker start-up and buffer filling
count for no one), non-padding tokens emitted per second over a fixed time, the texts repeating
endlessly. `padding` is the padded fraction of emitted positions. No BOS/EOS is added by anyone:
every token counted is a tokenizer output, so all rates compare with the ceiling directly.
Every configuration is measured once; the two fastest per (system, mode, seq_len) (the second
only if within 25 % of the first) are measured again and each keeps its better run, and the
ceiling is the best of passes before, between and after: load from something else on the
machine only slows a case down, so best-of is the estimate that a burst of it disturbs least.
The 1-minute load average before each case is in the sweep file.

The Zephon hook: set `ZEPHON_RUNNER`, or define `zephon_rows` (and optionally `RUNNERS`, a
tuple of runner names) in `benchmarks/pack_zephon.py` or in `zephon.ops.pack`. It is called as
`zephon_rows(texts, tokenizer, seq_len, batch, mode, runner) -> dict` for every mode in
MODES and every runner, and returns at least {"tokens_per_s", "padding", "tokens_lost"}
(fractions); `measure_stream` measures an iterator of batches the same way the Grain rows are.

Writes benchmarks/results/pack.json (the rows: list of {"system", "mode", "seq_len", "runner",
"tokens_per_s", "padding", "tokens_lost"}), pack_sweep.json (every configuration tried, and the
corpus) and pack.png.

    python benchmarks/pack.py            # full run: ~6.4 MB of prose, 6-8 minutes on 2 cores
    python benchmarks/pack.py --replot   # redraw pack.png from the JSON files
    python benchmarks/pack.py --quick    # ~2 MB, short windows, fewer configurations: ~1 min
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from absl import flags

flags.FLAGS.mark_as_parsed()  # grain reads absl flags; no absl main() runs here

import grain  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if __name__ == "__main__":
    # The Zephon hook imports `pack` (for measure_stream); without this it would get a second
    # copy of this module, whose TIMING the command line never set.
    sys.modules.setdefault("pack", sys.modules[__name__])

from zephon.demo.textdata import generate_corpus, train_bpe  # noqa: E402

MODES = ("concat", "first_fit", "best_fit")
SEQ_LENS = (512, 2048)
BATCH = 32
#: Open bins of Grain's first-/best-fit: one batch worth, as MaxText configures it.
NUM_PACKING_BINS = 32
ENCODE_CHUNK = 1024
GRAIN_ENCODE_BATCH = 256

#: The Zephon side: `zephon_rows(texts, tokenizer, seq_len, batch, mode, runner) -> dict`.
ZEPHON_RUNNER: Callable[..., dict[str, Any]] | None = None
ZEPHON_RUNNERS: tuple[str, ...] = ("inline", "threads", "processes")


@dataclass
class Timing:
    """Warm-up and measuring window of every pipeline case, in seconds."""

    warmup_s: float = 0.75
    seconds: float = 2.5


TIMING = Timing()


# --- Grain's side: module level, so spawned mp_prefetch workers can unpickle it ---------------


class TokenizeText(grain.transforms.Map):
    """One text -> {"tokens": int32 ids}, optionally truncated to `limit` tokens."""

    def __init__(self, tokenizer: Any, limit: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.limit = limit

    def map(self, text: str) -> dict[str, np.ndarray]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.limit is not None:
            ids = ids[:self.limit]
        return {"tokens": np.asarray(ids, dtype=np.int32)}


class TokenizeTexts(grain.transforms.Map):
    """A list of texts -> a list of {"tokens": ...}, with one `encode_batch` call."""

    def __init__(self, tokenizer: Any, limit: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.limit = limit

    def map(self, texts: list[str]) -> list[dict[str, np.ndarray]]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        limit = self.limit
        return [{"tokens": np.asarray(e.ids if limit is None else e.ids[:limit], dtype=np.int32)}
                for e in encodings]


class CachedTokenizeText(grain.transforms.Map):
    """`TokenizeText` through Zephon's pre-token cache (same ids, less work): the reference
    that puts Grain's pipeline on Zephon's tokenizing cost. One cache per worker process."""

    def __init__(self, tokenizer: Any, limit: int | None = None) -> None:
        from zephon.ops.pretokens import PretokenCache

        self.cache = PretokenCache(tokenizer, 1 << 17)
        self.limit = limit

    def map(self, text: str) -> dict[str, np.ndarray]:
        ids = self.cache.encode([text])[0]
        return {"tokens": ids if self.limit is None else ids[:self.limit]}


class Unbatch(grain.experimental.FlatMapTransform):
    """Undoes `TokenizeTexts`' grouping: one element per document again."""

    max_fan_out = GRAIN_ENCODE_BATCH

    def flat_map(self, element: list[Any]) -> list[Any]:
        return element


def _as_list(texts: Sequence[str]) -> list[str]:
    return list(texts)


GRAIN_RUNNERS_ALL = ("iter threads=0", "iter threads=16", "mp_prefetch workers=2 threads=0",
                     "batch-encode iter threads=0", "batch-encode mp_prefetch workers=2 threads=0",
                     "pretoken-cache mp_prefetch workers=2 threads=0")
#: The default run skips two configurations that never won a row, to stay near 6 minutes:
#: Grain's default ReadOptions (16 threads) ran at about half the rate of threads=0 in every
#: mode (GIL contention: the tokenizer's encode holds the GIL), and batch-encode without worker
#: processes was behind batch-encode with them or plain iteration. `--grain-runners all` has both.
GRAIN_RUNNERS = tuple(r for r in GRAIN_RUNNERS_ALL
                      if r not in ("iter threads=16", "batch-encode iter threads=0"))
GRAIN_RUNNERS_QUICK = ("iter threads=0", "batch-encode mp_prefetch workers=2 threads=0")


def grain_pipeline(texts: Sequence[str], tokenizer: Any, seq_len: int, batch: int, mode: str,
                   runner: str) -> grain.IterDataset:
    """Grain's tokenize+pack pipeline over `texts` repeated forever, configured by `runner`."""
    limit = None if mode == "concat" else seq_len  # first-/best-fit raise on longer documents
    threads = int(runner.rsplit("threads=", 1)[1])
    read = grain.ReadOptions(num_threads=threads) if threads else grain.ReadOptions(num_threads=0)
    ds = grain.MapDataset.source(list(texts)).repeat()
    if runner.startswith("pretoken-cache"):
        it = ds.map(CachedTokenizeText(tokenizer, limit)).to_iter_dataset(read)
    elif runner.startswith("batch-encode"):
        ds = ds.batch(GRAIN_ENCODE_BATCH, batch_fn=_as_list).map(TokenizeTexts(tokenizer, limit))
        it = grain.experimental.FlatMapIterDataset(ds.to_iter_dataset(read), Unbatch())
    else:
        it = ds.map(TokenizeText(tokenizer, limit)).to_iter_dataset(read)
    length = {"tokens": seq_len}
    if mode == "concat":
        it = grain.experimental.ConcatThenSplitIterDataset(it, length_struct=length)
    elif mode == "first_fit":
        it = grain.experimental.FirstFitPackIterDataset(it, length_struct=length,
                                                        num_packing_bins=NUM_PACKING_BINS)
    elif mode == "best_fit":
        it = grain.experimental.BestFitPackIterDataset(it, length_struct=length,
                                                       num_packing_bins=NUM_PACKING_BINS)
    else:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    it = it.batch(batch, drop_remainder=True)
    if "mp_prefetch" in runner:
        workers = int(runner.split("workers=")[1].split()[0])
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return it


# --- measuring ---------------------------------------------------------------------------------

_SEGMENT_FIELDS = ("tokens_segment_ids", "segment_ids", "inputs_segmentation")


def count_tokens(batch: dict[str, Any]) -> tuple[int, int]:
    """(non-padding tokens, positions) of one packed batch, from its segment ids (0 = pad)."""
    for name in _SEGMENT_FIELDS:
        if name in batch:
            seg = np.asarray(batch[name])
            return int(np.count_nonzero(seg)), int(seg.size)
    raise KeyError(f"no segment ids in batch fields {sorted(batch)}; expected one of "
                   f"{_SEGMENT_FIELDS}")


def measure_stream(batches: Iterable[Any], *, warmup_s: float | None = None,
                   seconds: float | None = None,
                   count: Callable[[Any], tuple[int, int]] = count_tokens) -> dict[str, float]:
    """Steady-state rate of an endless stream of packed batches.

    The clock starts after the first batch plus `warmup_s`, so process start-up and filling
    prefetch buffers are not charged; then batches are drawn for `seconds`. Returns
    tokens_per_s (non-padding tokens out per second), padding (padded fraction of positions),
    first_batch_s and the counts. The iterator is closed afterwards (Grain's mp_prefetch needs
    it to end its workers).
    """
    warmup_s = TIMING.warmup_s if warmup_s is None else warmup_s
    seconds = TIMING.seconds if seconds is None else seconds
    t0 = time.perf_counter()
    it: Iterator[Any] = iter(batches)
    try:
        next(it)
        first = time.perf_counter() - t0
        t = time.perf_counter()
        while time.perf_counter() - t < warmup_s:
            next(it)
        tokens = positions = n = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            got, pos = count(next(it))
            tokens += got
            positions += pos
            n += 1
        elapsed = time.perf_counter() - start
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return {"tokens_per_s": tokens / elapsed, "padding": 1 - tokens / max(positions, 1),
            "first_batch_s": first, "batches": n, "tokens": tokens, "seconds": elapsed}


def encode_batch_ceiling(tokenizer: Any, texts: Sequence[str], *, chunk: int = ENCODE_CHUNK,
                         repeats: int = 3) -> dict[str, float]:
    """Tokens/s of `tokenizer.encode_batch` over `texts` in chunks of `chunk`, best of
    `repeats` passes: the tokenizer's own batched rate in one process, the reference the
    issue's targets are ratios of (several processes can exceed it, see the module doc)."""
    best = 0.0
    tokens = 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(texts), chunk):
            for enc in tokenizer.encode_batch(list(texts[i:i + chunk]), add_special_tokens=False):
                tokens += len(enc.ids)
        best = max(best, tokens / (time.perf_counter() - start))
    return {"tokens_per_s": best, "tokens": tokens}


def token_lengths(tokenizer: Any, texts: Sequence[str]) -> np.ndarray:
    return np.array([len(e.ids) for e in tokenizer.encode_batch(list(texts),
                                                                 add_special_tokens=False)])


def truncation_loss(lengths: np.ndarray, limit: int | None) -> float:
    """Fraction of all tokens that truncating every document to `limit` tokens throws away."""
    if limit is None:
        return 0.0
    return float(np.maximum(lengths - limit, 0).sum() / lengths.sum())


# --- the Zephon hook ---------------------------------------------------------------------------


def find_zephon_runner() -> tuple[Callable[..., dict[str, Any]] | None, tuple[str, ...]]:
    """`ZEPHON_RUNNER` if set, else `zephon_rows` from benchmarks/pack_zephon.py or
    zephon.ops.pack, whichever imports first; (None, ()) when Zephon has no packer yet."""
    if ZEPHON_RUNNER is not None:
        return ZEPHON_RUNNER, ZEPHON_RUNNERS
    for name in ("pack_zephon", "zephon.ops.pack"):
        try:
            module = __import__(name, fromlist=["zephon_rows"])
        except ImportError:
            continue
        except Exception as e:  # a hook module being edited: say so, still run the baselines
            print(f"zephon: importing {name} failed ({type(e).__name__}: {e}); skipping it")
            continue
        fn = getattr(module, "zephon_rows", None)
        if fn is not None:
            return fn, tuple(getattr(module, "RUNNERS", ZEPHON_RUNNERS))
    return None, ()


# --- the run -----------------------------------------------------------------------------------


def is_reference(runner: str) -> bool:
    """Measured for comparison, never a headline row (see the module doc)."""
    return "cache" in runner


def _row(system: str, mode: str, seq_len: int, runner: str, tokens_per_s: float, padding: float,
         tokens_lost: float) -> dict[str, Any]:
    return {"system": system, "mode": mode, "seq_len": seq_len, "runner": runner,
            "tokens_per_s": round(float(tokens_per_s), 1), "padding": round(float(padding), 5),
            "tokens_lost": round(float(tokens_lost), 5)}


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Runs every case; returns (rows for pack.json, the sweep and corpus description)."""
    t_start = time.perf_counter()
    TIMING.warmup_s, TIMING.seconds = args.warmup, args.seconds
    t = time.perf_counter()
    texts = generate_corpus(args.docs, seed=args.seed, style="prose")
    gen_s = time.perf_counter() - t
    t = time.perf_counter()
    tokenizer = train_bpe(texts, vocab_size=args.vocab)
    train_s = time.perf_counter() - t
    lengths = token_lengths(tokenizer, texts)
    corpus = {"docs": len(texts), "mb": round(sum(map(len, texts)) / 1e6, 2),
              "tokens": int(lengths.sum()), "median_doc_tokens": float(np.median(lengths)),
              "docs_over_512": float(np.mean(lengths > 512)),
              "docs_over_2048": float(np.mean(lengths > 2048)), "vocab": args.vocab,
              "seed": args.seed, "generate_s": round(gen_s, 2), "train_bpe_s": round(train_s, 2)}
    print(f"corpus: {corpus['docs']} docs, {corpus['mb']} MB, {corpus['tokens']:,} tokens "
          f"(median doc {corpus['median_doc_tokens']:.0f}, >2048: "
          f"{corpus['docs_over_2048']:.1%}); BPE {args.vocab} trained in {train_s:.1f} s")

    ceiling = encode_batch_ceiling(tokenizer, texts, repeats=args.repeats)
    print(f"encode_batch ceiling: {ceiling['tokens_per_s']:,.0f} tokens/s")

    grain_runners = {"quick": GRAIN_RUNNERS_QUICK, "default": GRAIN_RUNNERS,
                     "all": GRAIN_RUNNERS_ALL}.get(args.grain_runners)
    if grain_runners is None:
        grain_runners = tuple(r.strip() for r in args.grain_runners.split(",") if r.strip())
    grain_runners = [r for r in grain_runners
                     if args.batch_encode or not r.startswith("batch-encode")]
    zephon_fn, zephon_runners = (None, ()) if args.no_zephon else find_zephon_runner()
    cases = [(sl, mode, "grain", r) for sl in args.seq_lens for mode in MODES
             for r in grain_runners]
    cases += [(sl, mode, "zephon", r) for sl in args.seq_lens for mode in MODES
              for r in zephon_runners]
    if zephon_fn is None and not args.no_zephon:
        print("zephon: no zephon_rows hook found (benchmarks/pack_zephon.py, zephon.ops.pack); "
              "running the baselines only")

    sweep: list[dict[str, Any]] = []

    def measure(seq_len: int, mode: str, system: str, runner: str) -> dict[str, Any]:
        gc.collect()
        load = os.getloadavg()[0]  # on a shared machine: was a slow case slow, or the machine busy?
        if system == "grain":
            m = measure_stream(grain_pipeline(texts, tokenizer, seq_len, BATCH, mode, runner))
            m["tokens_lost"] = truncation_loss(lengths, None if mode == "concat" else seq_len)
        else:
            assert zephon_fn is not None
            m = dict(zephon_fn(texts, tokenizer, seq_len, BATCH, mode, runner))
        entry = {"system": system, "mode": mode, "seq_len": seq_len, "runner": runner, **m,
                 "loadavg_1min": round(load, 2)}
        sweep.append(entry)
        return entry

    bar = tqdm(cases, desc="pack cases", unit="case", dynamic_ncols=True)
    for seq_len, mode, system, runner in bar:
        bar.set_postfix_str(f"{system} {mode} {seq_len} {runner}")
        e = measure(seq_len, mode, system, runner)
        tqdm.write(f"  {system:6} {mode:9} {seq_len:5} {runner:46} "
                   f"{e['tokens_per_s']:>9,.0f} tok/s  pad {e['padding']:6.2%}  "
                   f"lost {e['tokens_lost']:6.2%}  (load {e['loadavg_1min']:.1f})",
                   file=sys.stdout)

    # Second chance for the two fastest configurations of each (system, mode, seq_len): load
    # from elsewhere only ever slows a case down, so each configuration keeps its better run,
    # and the ranking is decided on those.
    if args.rounds > 1:
        middle = encode_batch_ceiling(tokenizer, texts, repeats=args.repeats)
        ceiling["tokens_per_s"] = max(ceiling["tokens_per_s"], middle["tokens_per_s"])
        first_round = list(sweep)
        again = []
        def group(e: dict[str, Any]) -> tuple[str, bool, str, int]:
            return e["system"], is_reference(e["runner"]), e["mode"], e["seq_len"]

        for key in {group(e) for e in first_round}:
            ranked = sorted((e for e in first_round if group(e) == key),
                            key=lambda e: -e["tokens_per_s"])
            top = ranked[0]["tokens_per_s"]
            close = [e for e in ranked[:2] if e["tokens_per_s"] >= 0.75 * top]
            again += [(e["seq_len"], e["mode"], e["system"], e["runner"]) for e in close]
        again.sort(key=lambda c: cases.index(c))
        for seq_len, mode, system, runner in tqdm(again, desc="re-measure top 2", unit="case"):
            e = measure(seq_len, mode, system, runner)
            tqdm.write(f"  {system:6} {mode:9} {seq_len:5} {runner:46} "
                       f"{e['tokens_per_s']:>9,.0f} tok/s  (again; load "
                       f"{e['loadavg_1min']:.1f})", file=sys.stdout)
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for e in sweep:
        key = (e["system"] + " (reference)" * is_reference(e["runner"]), e["mode"], e["seq_len"])
        if key not in best or e["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = e
    again = encode_batch_ceiling(tokenizer, texts, repeats=args.repeats)
    ceiling["tokens_per_s"] = max(ceiling["tokens_per_s"], again["tokens_per_s"])

    passes = 3 if args.rounds > 1 else 2
    rows = []
    references = [_row(e["system"], e["mode"], e["seq_len"], e["runner"], e["tokens_per_s"],
                       e["padding"], e["tokens_lost"])
                  for (system, mode, seq_len), e in sorted(
                      best.items(), key=lambda kv: (kv[0][2], kv[0][0], MODES.index(kv[0][1])))
                  if "(reference)" in system]
    for seq_len in args.seq_lens:
        rows.append(_row("encode_batch", "ceiling", seq_len,
                         f"encode_batch chunks of {ENCODE_CHUNK}, best of {passes * args.repeats} "
                         "passes over the corpus",
                         ceiling["tokens_per_s"], 0.0, 0.0))
        for system in ("zephon", "grain"):
            for mode in MODES:
                e = best.get((system, mode, seq_len))
                if e is not None:
                    rows.append(_row(system, mode, seq_len, e["runner"], e["tokens_per_s"],
                                     e["padding"], e["tokens_lost"]))
    total_s = time.perf_counter() - t_start
    meta = {"corpus": corpus, "references": references, "batch": BATCH, "num_packing_bins": NUM_PACKING_BINS,
            "timing": {"warmup_s": TIMING.warmup_s, "seconds": TIMING.seconds},
            "quick": args.quick, "total_s": round(total_s, 1), "machine": {
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "grain": getattr(grain, "__version__", "?"),
                "tokenizers": __import__("tokenizers").__version__},
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "sweep": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in e.items()}
                      for e in sweep]}
    return rows, meta


def print_table(rows: list[dict[str, Any]], references: list[dict[str, Any]]) -> None:
    ceilings = {r["seq_len"]: r["tokens_per_s"] for r in rows if r["system"] == "encode_batch"}
    print(f"\n{'system':12} {'mode':9} {'seq':>5} {'tokens/s':>11} {'of ceil':>8} "
          f"{'padding':>8} {'lost':>7}  runner")
    for r in rows + [{**r, "system": r["system"] + " ref"} for r in references]:
        print(f"{r['system']:12} {r['mode']:9} {r['seq_len']:5} {r['tokens_per_s']:>11,.0f} "
              f"{r['tokens_per_s'] / ceilings[r['seq_len']]:>8.0%} {r['padding']:>8.2%} "
              f"{r['tokens_lost']:>7.2%}  {r['runner']}")


def plot(rows: list[dict[str, Any]], references: list[dict[str, Any]], path: Path,
         title: str) -> None:
    """Bars: tokens/s per mode (one colour a system, hatched: its reference run) for each
    seq_len; line: the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq_lens = sorted({r["seq_len"] for r in rows})
    colors = {"zephon": "#2b7bba", "grain": "#e8902e"}
    labels = {("zephon", False): "zephon", ("zephon", True): "zephon, pre-token cache off (ref.)",
              ("grain", False): "grain", ("grain", True): "grain + Zephon's pre-token cache (ref.)"}
    series = [(system, ref, [r for r in (references if ref else rows) if r["system"] == system])
              for system in ("zephon", "grain") for ref in (False, True)]
    series = [s for s in series if s[2]]
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(7.5 * len(seq_lens), 5.0), sharey=True,
                             squeeze=False)
    top = max(r["tokens_per_s"] for r in rows + references) * 1.25 / 1e3
    for ax, seq_len in zip(axes[0], seq_lens):
        width = 0.84 / max(len(series), 1)
        for k, (system, ref, mine) in enumerate(series):
            for j, mode in enumerate(MODES):
                r = next((r for r in mine if (r["mode"], r["seq_len"]) == (mode, seq_len)), None)
                if r is None:
                    continue
                x = j + (k - (len(series) - 1) / 2) * width
                ax.bar(x, r["tokens_per_s"] / 1e3, width * 0.95, color=colors[system],
                       hatch="//" if ref else None, alpha=0.55 if ref else 1.0,
                       label=labels[system, ref] if j == 0 else None)
                note = f"pad {r['padding']:.1%}\nlost {r['tokens_lost']:.0%}"
                ax.text(x, r["tokens_per_s"] / 1e3, note, ha="center", va="bottom", fontsize=6)
                ax.text(x, 4, r["runner"].replace(" threads=0", "").replace(" ", "\n", 1),
                        ha="center", va="bottom", fontsize=5, rotation=90, color="k" if ref else "white")
        ceiling = next(r["tokens_per_s"] for r in rows
                       if r["system"] == "encode_batch" and r["seq_len"] == seq_len)
        ax.axhline(ceiling / 1e3, color="k", ls="--", lw=1,
                   label=f"encode_batch ceiling ({ceiling / 1e3:,.0f}k)")
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_title(f"seq_len {seq_len}, batch {BATCH}")
        ax.set_ylim(0, top)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("non-padding tokens/s (thousands)")
    axes[0][-1].legend(loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/pack.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=5000, help="generated prose documents (~1.4 KB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)))
    p.add_argument("--warmup", type=float, default=Timing.warmup_s,
                   help="seconds after the first batch")
    p.add_argument("--seconds", type=float, default=Timing.seconds,
                   help="measured seconds per case")
    p.add_argument("--rounds", type=int, default=2,
                   help="2: measure the two fastest configurations a second time, keep the "
                        "better run of each")
    p.add_argument("--repeats", type=int, default=3, help="encode_batch passes (each time)")
    p.add_argument("--no-batch-encode", dest="batch_encode", action="store_false",
                   help="Grain tokenizes one text per .map call only")
    p.add_argument("--grain-runners", default="default",
                   help="default | all (adds Grain's default 16 read threads) | quick | a "
                        "comma-separated list of runner names from GRAIN_RUNNERS_ALL")
    p.add_argument("--no-zephon", action="store_true", help="baselines only")
    p.add_argument("--quick", action="store_true", help="~1 minute: fewer docs and configurations")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--name", default="pack")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--replot", action="store_true",
                   help="redraw the PNG and table from the JSON files, measure nothing")
    args = p.parse_args(argv)
    args.seq_lens = [int(s) for s in str(args.seq_lens).split(",")]
    if args.quick:
        args.docs = min(args.docs, 1500)
        args.warmup, args.seconds, args.rounds, args.repeats = 0.5, 1.0, 1, 2
        if args.grain_runners == "default":
            args.grain_runners = "quick"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.replot:
        rows = json.loads((out / f"{args.name}.json").read_text())
        meta = json.loads((out / f"{args.name}_sweep.json").read_text())
        meta.setdefault("references", [])
    else:
        rows, meta = run(args)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / f"{args.name}_sweep.json").write_text(json.dumps(meta, indent=1) + "\n")
    print_table(rows, meta["references"])
    if not args.no_plot:
        c = meta["corpus"]
        loads = [e["loadavg_1min"] for e in meta["sweep"] if "loadavg_1min" in e]
        busy = (f", load avg {min(loads):.1f}-{max(loads):.1f} during the run"
                if loads and max(loads) > 1.5 * meta["machine"]["cpus"] / 2 else "")
        plot(rows, meta["references"], out / f"{args.name}.png",
             f"tokenize + pack, {c['mb']} MB generated prose ({c['tokens']:,} tokens), BPE "
             f"{c['vocab']}, {meta['machine']['cpus']} CPUs{busy}"
             + (" (quick)" if meta.get("quick") else ""))
    if not args.replot:
        print(f"\nwrote {out / args.name}.json, _sweep.json, .png in {meta['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

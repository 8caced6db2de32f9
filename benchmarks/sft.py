"""Chat SFT data, head to head: render + tokenize + best-fit pack, Zephon vs Grain's best.

Issue 24 asks for tokens/s of chat rendering + tokenizing + best-fit packing against the same
work in Grain, same data and tokenizer, one run; target Zephon >= 1.5x Grain's best, 0 tokens
lost, padding <= Grain's.

Data: `zephon.demo.chatdata.generate_chats` conversations (system prompt sometimes, 1-3 exchanges,
answers from a few tokens to a few hundred), a byte-level BPE trained on them in-process, the
template `<|role|>\\n{content}<|end|>\\n` with the assistant's turns trained. Both sides render
with the same `ChatTemplate.render` (the same text pieces) and get the same token ids (Zephon's
pre-token cache is exact: ids equal `encode_batch`'s).

  grain   `MapDataset.source(conversations).repeat().map(render+tokenize)` ->
          `to_iter_dataset` -> `BestFitPackIterDataset` | `FirstFitPackIterDataset`
          (length_struct tokens + loss_mask, 32 bins) -> `.batch(32)`, each under
            iter threads=0              plain iteration, ReadOptions(num_threads=0)
            mp_prefetch workers=2       the pipeline in 2 processes
            batch-encode mp_prefetch    `.batch(256).map(render all + one encode_batch)` +
                                        unbatch, in 2 processes
          Grain's packers raise on a document longer than seq_len, so the map truncates
          (`tokens_lost`: the fraction of tokens cut). The fastest configuration is Grain's row.
  zephon  `Loader(Source(n).repeat().lanes(8).batch(32), [Chat(tok), Pack(L, "best_fit",
          max_open_bins=32)])` with runner inline | processes(2); longer documents are split,
          never cut (`tokens_lost` 0). The fastest runner is Zephon's row.

Rates are non-padding tokens out per second, steady state (after the first batch and a
warm-up). The machine is shared and its load swings within seconds, so every configuration is
measured in `--rounds` rounds, interleaved (round-robin), and keeps its best window: load from
something else only slows a case down, so best-of is the estimate a burst disturbs least.
The 1-minute load average before each window is kept. `padding` is the padded fraction of
positions. Writes benchmarks/results/sft.json and sft.png.

    python benchmarks/sft.py           # ~6 minutes on 2 cores
    python benchmarks/sft.py --quick   # short windows, fewer configurations
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from absl import flags

flags.FLAGS.mark_as_parsed()  # grain reads absl flags; no absl main() runs here

import grain  # noqa: E402
import numpy as np  # noqa: E402
from pack import measure_stream  # noqa: E402  (benchmarks/ is sys.path[0] when this script runs)

from zephon import How, Loader, Pipeline, Source  # noqa: E402
from zephon.demo.chatdata import chat_texts, generate_chats  # noqa: E402
from zephon.demo.textdata import train_bpe  # noqa: E402
from zephon.ops.chat import Chat, ChatTemplate  # noqa: E402
from zephon.ops.pack import Pack  # noqa: E402
from zephon.sources.columns import objects  # noqa: E402
from zephon.sources.memory import ArraySource  # noqa: E402

HERE = Path(__file__).resolve().parent
SEQ_LEN, BATCH, BINS, LANES, ENCODE_BATCH = 1024, 32, 32, 8, 256
TEMPLATE = ChatTemplate(turn="<|{role}|>\n{content}<|end|>\n")
TRAIN = frozenset({"assistant"})


# --- Grain's side: module level, so spawned mp_prefetch workers can unpickle it ---------------
def render_encode(tokenizer: Any, convs: list[list[dict[str, str]]], limit: int) -> list[dict[str, np.ndarray]]:
    """Conversations -> {"tokens", "loss_mask"} with one encode_batch call over all pieces,
    truncated to `limit` tokens (Grain's packers refuse longer documents)."""
    pieces = [TEMPLATE.render(c, TRAIN) for c in convs]
    enc = tokenizer.encode_batch([t for p in pieces for t, _ in p], add_special_tokens=False)
    out, k = [], 0
    for p in pieces:
        ids = [np.asarray(e.ids, np.int32) for e in enc[k:k + len(p)]]
        mask = [np.full(len(x), on, np.int32) for x, (_, on) in zip(ids, p)]
        k += len(p)
        out.append({"tokens": np.concatenate(ids)[:limit], "loss_mask": np.concatenate(mask)[:limit]})
    return out


class RenderTokenize(grain.transforms.Map):
    def __init__(self, tokenizer: Any, limit: int) -> None:
        self.tokenizer, self.limit = tokenizer, limit

    def map(self, conv: list[dict[str, str]]) -> dict[str, np.ndarray]:
        return render_encode(self.tokenizer, [conv], self.limit)[0]


class RenderTokenizeMany(RenderTokenize):
    def map(self, convs: list[list[dict[str, str]]]) -> list[dict[str, np.ndarray]]:  # type: ignore[override]
        return render_encode(self.tokenizer, convs, self.limit)


class Unbatch(grain.experimental.FlatMapTransform):
    max_fan_out = ENCODE_BATCH

    def flat_map(self, element: list[Any]) -> list[Any]:
        return element


def _as_list(x: Any) -> list[Any]:
    return list(x)


GRAIN_RUNNERS = ("iter threads=0", "mp_prefetch workers=2", "batch-encode mp_prefetch workers=2")


def grain_pipeline(convs: list[list[dict[str, str]]], tokenizer: Any, mode: str, runner: str) -> Any:
    read = grain.ReadOptions(num_threads=0)
    ds = grain.MapDataset.source(convs).repeat()
    if runner.startswith("batch-encode"):
        ds = ds.batch(ENCODE_BATCH, batch_fn=_as_list).map(RenderTokenizeMany(tokenizer, SEQ_LEN))
        it = grain.experimental.FlatMapIterDataset(ds.to_iter_dataset(read), Unbatch())
    else:
        it = ds.map(RenderTokenize(tokenizer, SEQ_LEN)).to_iter_dataset(read)
    exp = grain.experimental
    cls = exp.BestFitPackIterDataset if mode == "best_fit" else exp.FirstFitPackIterDataset
    it = cls(it, length_struct={"tokens": SEQ_LEN, "loss_mask": SEQ_LEN}, num_packing_bins=BINS)
    it = it.batch(BATCH, drop_remainder=True)
    if "mp_prefetch" in runner:
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    return it


# --- Zephon's side -----------------------------------------------------------------------------
def zephon_stream(convs: list[list[dict[str, str]]], tokenizer: Any, runner: str) -> Iterator[dict[str, Any]]:
    from zephon import runners

    run = None if runner == "inline" else runners.processes(2)
    loader = Loader(Pipeline(Source(len(convs)).repeat().lanes(LANES).batch(BATCH),
                             ArraySource({"messages": objects(convs)}),
                             [Chat(tokenizer, template=TEMPLATE), Pack(SEQ_LEN, "best_fit", max_open_bins=BINS)]),
                    how=How(runner=run))
    try:
        for b in loader:
            yield b.data
    finally:
        loader.close()


# --- measuring ---------------------------------------------------------------------------------
def count(batch: dict[str, Any]) -> tuple[int, int, int]:
    """(non-padding tokens, positions, trained tokens) of one packed batch."""
    seg = np.asarray(batch["segment_ids"] if "segment_ids" in batch else batch["tokens_segment_ids"])
    return int(np.count_nonzero(seg)), int(seg.size), int(np.count_nonzero(batch["loss_mask"]))


def measure(batches: Iterable[Any], warmup_s: float, seconds: float) -> dict[str, float]:
    """`pack.measure_stream`'s steady-state rate, plus the trained fraction of the tokens."""
    trained = 0

    def tokens_and_positions(batch: dict[str, Any]) -> tuple[int, int]:
        nonlocal trained
        tokens, positions, got = count(batch)
        trained += got
        return tokens, positions

    m = measure_stream(batches, warmup_s=warmup_s, seconds=seconds, count=tokens_and_positions)
    return {**m, "trained_fraction": trained / max(m["tokens"], 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    chats = generate_chats(args.conversations, seed=0)
    convs = [c["messages"] for c in chats]
    tok = train_bpe(chat_texts(chats) + ["<|user|>\n<|assistant|>\n<|system|>\n<|end|>\n"] * 100,
                    vocab_size=2048)
    lengths = np.array([len(r["tokens"]) for r in render_encode(tok, convs, 1 << 30)])
    lost = float(np.maximum(lengths - SEQ_LEN, 0).sum() / lengths.sum())
    rows: list[dict[str, Any]] = []
    grain_runners = GRAIN_RUNNERS[:1] + GRAIN_RUNNERS[2:] if args.quick else GRAIN_RUNNERS
    cases = [("grain", m, r) for m in ("best_fit", "first_fit") for r in grain_runners]
    cases += [("zephon", "best_fit", r) for r in (("inline",) if args.quick else ("inline", "processes(2)"))]
    windows: dict[tuple[str, str, str], list[dict[str, Any]]] = {c: [] for c in cases}
    for rnd in range(args.rounds):
        for system, mode, runner in cases:
            load = os.getloadavg()[0]
            stream = (grain_pipeline(convs, tok, mode, runner) if system == "grain"
                      else zephon_stream(convs, tok, runner.split("(")[0]))
            m = {**measure(stream, args.warmup, args.seconds), "load_1min_before": load}
            windows[(system, mode, runner)].append(m)
            print(f"round {rnd}: {system:6s} {mode:9s} {runner:36s} {m['tokens_per_s']:12,.0f} tok/s  "
                  f"padding {m['padding']:.4f}  (load {load:.1f})", flush=True)
    for (system, mode, runner), ms in windows.items():
        best_m = max(ms, key=lambda m: m["tokens_per_s"])
        rows.append({"system": system, "mode": mode, "runner": runner, **best_m,
                     "tokens_lost": lost if system == "grain" else 0.0,
                     "windows_tokens_per_s": [m["tokens_per_s"] for m in ms]})
    best = {s: max((r for r in rows if r["system"] == s), key=lambda r: r["tokens_per_s"]) for s in ("grain", "zephon")}
    ratio = best["zephon"]["tokens_per_s"] / best["grain"]["tokens_per_s"]
    return {"rows": rows, "best": best, "ratio": ratio, "target_ratio": 1.5, "seq_len": SEQ_LEN,
            "batch": BATCH, "packing_bins": BINS, "conversations": len(convs),
            "mean_tokens_per_conversation": float(lengths.mean()), "longest": int(lengths.max()),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "timing": {"warmup_s": args.warmup, "seconds": args.seconds}}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    labels = [f"{r['system']} {r['mode']} {r['runner']}" for r in rows]
    ax.barh(labels, [r["tokens_per_s"] for r in rows],
            color=["tab:blue" if r["system"] == "zephon" else "tab:gray" for r in rows])
    for i, r in enumerate(rows):
        ax.text(r["tokens_per_s"], i, f" pad {r['padding']:.3f} lost {r['tokens_lost']:.3f}", va="center", fontsize=8)
    ax.set_xlabel("non-padding tokens / s")
    ax.set_title(f"chat render + tokenize + pack, seq {SEQ_LEN}: Zephon / Grain best = {result['ratio']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    args.warmup, args.seconds = (0.5, 2.0) if args.quick else (1.0, 4.0)
    result = run(args)
    b = result["best"]
    print(f"Zephon best {b['zephon']['tokens_per_s']:,.0f} tok/s ({b['zephon']['runner']}), Grain best "
          f"{b['grain']['tokens_per_s']:,.0f} tok/s ({b['grain']['mode']}, {b['grain']['runner']}): "
          f"{result['ratio']:.2f}x (target 1.5x); padding {b['zephon']['padding']:.4f} vs "
          f"{b['grain']['padding']:.4f}; tokens lost {b['zephon']['tokens_lost']:.4f} vs "
          f"{b['grain']['tokens_lost']:.4f}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "sft_quick" if args.quick else "sft"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        plot(result, args.out / f"{name}.png")
    except ImportError:  # pragma: no cover - matplotlib is the [plots] extra
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

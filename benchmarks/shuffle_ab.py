"""Does the block shuffle cost training quality? A training A/B on the elastic-training model.

    make shuffle-ab                    # = python benchmarks/shuffle_ab.py (~4-6 min, 2 cores)
    python benchmarks/shuffle_ab.py --quick          # a smoke run (~1 min)

The tiny decoder-only LM of benchmarks/elastic_training.py (same model, optimiser, schedule and
data: Python standard library files + generated prose, byte-level BPE trained in-process) is
trained on pre-packed rows of `seq_len` tokens with three orders, two seeds each (the data-order
seed; the initial weights are the same in every run), and evaluated on held-out rows of both
corpora at equal steps:

  full       `Source(n).shuffle(seed)`: every row anywhere (the reference).
  block      `Source(n).block_shuffle(seed, block=b)` with the default window (2 × B blocks).
  small_w    the same blocks with a deliberately small window (`window=2`): a batch's rows come
             from about two blocks.

The rows are laid out the way real shards are: sorted by source and topic — the code corpus
first, file after file in the standard library's order (a file's rows are consecutive), then the
prose. Without such block-correlated structure a block shuffle cannot be told from a full one
(a block would be as varied as a random sample), and the small window could show nothing.

Writes benchmarks/results/shuffle_ab.json (config, the quality report of each plan, eval-loss
curves, final losses, the verdict) and shuffle_ab.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import elastic_training as et  # noqa: E402  (the model, data and schedule are reused as they are)

RESULTS = HERE / "results"
ORDERS = ("full", "block", "small_w")


@dataclasses.dataclass(frozen=True)
class AB:
    steps: int = 150
    eval_every: int = 15
    batch: int = 32               # global batch, rows of seq_len tokens
    lanes: int = 8
    block: int = 16               # rows per block (a "shard chunk" of consecutive rows)
    small_window: int = 2         # blocks per window of the deliberately bad order
    seeds: tuple[int, ...] = (1, 2)
    workers: int = 2


def plan_for(order: str, n: int, ab: AB, seed: int):
    import zephon as z

    stream = z.Source(n)
    if order == "full":
        stream = stream.shuffle(seed)
    elif order == "block":
        stream = stream.block_shuffle(seed, block=ab.block)
    else:
        stream = stream.block_shuffle(seed, block=ab.block, window=ab.small_window)
    return stream.repeat().lanes(ab.lanes).batch(ab.batch)


def pack_rows(cfg: et.Config, workdir: Path) -> dict[str, int]:
    """The training documents packed into rows, sorted by source: code files in order, then prose."""
    from tokenizers import Tokenizer

    from zephon.demo.textdata import EOS_ID

    corpora = json.loads((workdir / "corpora.json").read_text())
    tok = Tokenizer.from_file(str(workdir / "tokenizer.json"))
    out: dict[str, list[np.ndarray]] = {k: [] for k in (*et.FIELDS, "source")}
    counts = {}
    for source, name in enumerate(("code", "prose")):
        packer = et.ConcatSplit(cfg.seq_len)
        rows = []
        for e in tok.encode_batch(corpora[name], add_special_tokens=False):
            packer.add(np.array(e.ids + [EOS_ID], np.int64), source)
            rows += packer.rows()
        counts[name] = len(rows)
        for r in rows:
            for k in out:
                out[k].append(r[k])
    np.savez(workdir / "rows.npz", **{k: np.stack(v) for k, v in out.items()})
    return counts


def train(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    import zephon as z
    from zephon.sources.memory import ArraySource

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg, ab = et.Config(**job["cfg"]), AB(**{**job["ab"], "seeds": tuple(job["ab"]["seeds"])})
    with np.load(Path(job["workdir"], "rows.npz")) as f:
        rows = {k: f[k] for k in et.FIELDS}
    with np.load(Path(job["workdir"], "eval.npz")) as f:
        ev = {k: torch.from_numpy(f[k]).long() for k in f.files}
    n = len(rows["tokens"])
    plan = plan_for(job["order"], n, ab, job["seed"])
    model = et.make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    evals = [[0, et.evaluate(model, ev)]]
    t0 = time.perf_counter()
    with z.Loader(z.Pipeline(plan, ArraySource(rows))) as loader:
        for step in range(cfg.steps):
            batch = {k: torch.from_numpy(v).long() for k, v in next(loader).data.items()}
            for g in opt.param_groups:
                g["lr"] = et.lr_at(cfg, step)
            opt.zero_grad()
            ce, m = et.token_losses(model, batch)
            loss = (ce * m).sum() / m.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                evals.append([step + 1, et.evaluate(model, ev)])
    return {"order": job["order"], "seed": job["seed"], "eval": evals, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "shuffle_ab"))
    args = ap.parse_args(argv)
    ab = AB(steps=12, eval_every=4, batch=16) if args.quick else AB()
    base = et.QUICK if args.quick else et.Config()
    cfg = dataclasses.replace(base, steps=ab.steps, eval_every=ab.eval_every, batch=ab.batch,
                              warmup=min(base.warmup, ab.steps // 5))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zephon-ab-") as tmp:
        workdir = Path(tmp)
        corpus = et.prepare(cfg, workdir)
        counts = pack_rows(cfg, workdir)
        n = counts["code"] + counts["prose"]
        from zephon.plan.quality import shuffle_quality

        quality = {o: shuffle_quality(plan_for(o, n, ab, ab.seeds[0]), block=ab.block, rho=0.5).to_json()
                    for o in ORDERS}
        jobs = [{"order": o, "seed": s, "cfg": dataclasses.asdict(cfg), "ab": dataclasses.asdict(ab),
                 "workdir": str(workdir)} for o in ORDERS for s in ab.seeds]
        with mp.get_context("spawn").Pool(ab.workers) as pool:
            results = pool.map(train, jobs)
    final = {o: [r["eval"][-1][1] for r in results if r["order"] == o] for o in ORDERS}
    mean = {o: float(np.mean(v)) for o, v in final.items()}
    spread = {o: float(np.max(v) - np.min(v)) for o, v in final.items()}
    seed_spread = max(spread["full"], spread["block"])
    gap = {o: (mean[o] - mean["full"]) / mean["full"] for o in ORDERS}
    verdict = {
        "block_within_0.5%_or_seed_spread": bool(abs(gap["block"]) <= 0.005
                                                 or abs(mean["block"] - mean["full"]) <= seed_spread),
        "small_w_visibly_worse": bool(mean["small_w"] - mean["full"] > max(seed_spread, 0.005 * mean["full"])),
    }
    out = {"config": {"model": dataclasses.asdict(cfg), "ab": dataclasses.asdict(ab)}, "corpus": corpus,
           "rows": counts, "quality": quality, "runs": results, "final_eval_loss": final,
           "mean_final_eval_loss": mean, "seed_spread": spread, "gap_vs_full": gap, "verdict": verdict,
           "load_avg_1m_before": load, "load_avg_1m_after": os.getloadavg()[0],
           "wall_s": time.perf_counter() - t0,
           "command": "flock /tmp/zephon-bench.lock .venv/bin/python benchmarks/shuffle_ab.py"}
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    plot(out, args.out + ".png")
    for o in ORDERS:
        q = quality[o]
        print(f"{o:8} eval loss {mean[o]:.4f} (seeds {', '.join(f'{x:.4f}' for x in final[o])}; "
              f"{100 * gap[o]:+.2f} % vs full)  P_same {q['p_same']:.4f}  eff. batch (rho=0.5) "
              f"{q['effective_batch']:.1f} of {q['batch']}")
    print("verdict:", verdict, f"({out['wall_s']:.0f} s)")


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"full": "black", "block": "tab:blue", "small_w": "tab:red"}
    for r in out["runs"]:
        steps, losses = zip(*r["eval"])
        a.plot(steps, losses, color=colors[r["order"]], alpha=0.8,
               linestyle="-" if r["seed"] == out["config"]["ab"]["seeds"][0] else "--",
               label=f"{r['order']} seed {r['seed']}")
    a.set_xlabel("step")
    a.set_ylabel("eval loss")
    a.set_ylim(top=min(a.get_ylim()[1], 7))
    a.legend(fontsize=7)
    a.set_title("eval loss at equal steps")
    orders = list(out["mean_final_eval_loss"])
    b.bar(orders, [out["mean_final_eval_loss"][o] for o in orders], color=[colors[o] for o in orders],
          yerr=[out["seed_spread"][o] / 2 for o in orders])
    lo = min(min(v) for v in out["final_eval_loss"].values())
    b.set_ylim(bottom=lo * 0.97)
    for i, o in enumerate(orders):
        q = out["quality"][o]
        b.text(i, out["mean_final_eval_loss"][o], f"{100 * out['gap_vs_full'][o]:+.2f}%\nP_same {q['p_same']:.3f}",
               ha="center", va="bottom", fontsize=8)
    b.set_title("final eval loss (mean of seeds, bar: spread)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""The end of finite plans (issue 22): step counts at D = 1, 2, 4, 8, records / tokens lost, and
what agreeing on the end costs.

Two finite pipelines, both `remainder="pad"` and `"drop"`:

  filtered: 200,003 int64 records, shuffled, 8 lanes, batch 64, a batched filter keeping ~1/2
  packed:   3,000 generated prose documents, tokenized (trained BPE, EOS), Pack(256, concat),
            8 lanes, batch 16

For every D the ranks run one after another in this process; each rank counts only its own lanes
and the ranks agree through `ThreadGather` (the all-gather a distributed runtime would do), as
D processes would. Lost = records (tokens) of the data minus the valid ones emitted.

Cost: for rank 0 of D = 2, the seconds of the counting pass (its lanes through the pipeline once,
keeping counts) against the seconds of the epoch it then iterates, in the same run; the D = 1
epoch (no counting needed: one process owns every lane) as the reference.

    python benchmarks/finite_end.py      # writes benchmarks/results/finite_end.json
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import zephon as z
from zephon.demo.textdata import EOS_ID, generate_corpus, train_bpe
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.sources.memory import ArraySource
from zephon.testing.gather import ThreadGather

RESULTS = Path(__file__).resolve().parent / "results" / "finite_end.json"


def keep_half(cols: dict[str, np.ndarray]) -> np.ndarray:
    return (cols["x"] * 2654435761 % 1000) < 500


def filtered(remainder: str) -> tuple[Any, Any, Any, int]:
    n = 200_003
    src = ArraySource({"x": np.arange(n, dtype=np.int64)})
    plan = z.Source(n).shuffle(1).lanes(8).batch(64, remainder=remainder)
    kept = int(keep_half({"x": np.arange(n, dtype=np.int64)}).sum())
    return plan, src, lambda: [z.Filter(keep_half, batched=True, name="keep_half")], kept


_DOCS = generate_corpus(3000, seed=7)
_TOK = train_bpe(_DOCS[:500], vocab_size=1000)


def packed(remainder: str) -> tuple[Any, Any, Any, int]:
    src = ArraySource({"text": np.array(_DOCS, dtype=object)})
    plan = z.Source(len(_DOCS)).shuffle(2).lanes(8).batch(16, remainder=remainder)
    tokens = sum(len(e.ids) + 1 for e in _TOK.encode_batch(_DOCS))
    return plan, src, lambda: [Tokenize(_TOK, eos=EOS_ID), Pack(256, "concat")], tokens


def run_degree(plan: Any, src: Any, ops: Any, world: int) -> tuple[list[int], int, dict[str, float]]:
    """Steps per rank, valid rows/tokens emitted, and rank 0's count / iterate seconds."""
    gather = ThreadGather(world) if world > 1 else None
    steps, emitted = [0] * world, [0] * world
    times: dict[str, float] = {}

    def rank(r: int) -> None:
        ld = z.Loader(z.Pipeline(plan, src, ops()),
                      z.Where(rank=r, world=world, all_gather=None if gather is None else gather.for_rank(r)))
        t = time.perf_counter()
        if world > 1:
            ld.settle_end()
        t_count = time.perf_counter() - t
        t = time.perf_counter()
        for b in ld:
            steps[r] += 1
            if "segment_ids" in b.data:
                emitted[r] += int((b.data["segment_ids"] > 0).sum())
            else:
                emitted[r] += int(b.data["valid"].sum()) if "valid" in b.data else len(b.data["x"])
        if r == 0:
            times.update(count=t_count, iterate=time.perf_counter() - t)

    if world == 1:
        rank(0)
    else:  # ranks as threads: the all-gather needs them all at once (timings share the cores)
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    return steps, sum(emitted), times


def cost(plan: Any, src: Any, ops: Any) -> dict[str, float]:
    """Rank 0 of D = 2 alone, its all-gather answered with its own counts (no thread waits),
    against the D = 1 epoch: the counting pass is the only extra work."""
    t = time.perf_counter()
    for _ in z.Loader(z.Pipeline(plan, src, ops())):
        pass
    d1 = time.perf_counter() - t
    ld = z.Loader(z.Pipeline(plan, src, ops()), z.Where(rank=0, world=2, all_gather=lambda v: [v]))
    t = time.perf_counter()
    ld.settle_end()
    count = time.perf_counter() - t
    t = time.perf_counter()
    for _ in ld:
        pass
    it = time.perf_counter() - t
    return {"d1_epoch_s": d1, "rank0_count_s": count, "rank0_epoch_s": it,
            "count_over_epoch": count / it}


def main() -> None:
    out: dict[str, Any] = {}
    for name, make in (("filtered", filtered), ("packed", packed)):
        for remainder in ("pad", "drop"):
            plan, src, ops, total = make(remainder)
            row: dict[str, Any] = {"total": total, "unit": "tokens" if name == "packed" else "records"}
            for d in (1, 2, 4, 8):
                steps, emitted, _ = run_degree(plan, src, ops, d)
                assert len(set(steps)) == 1, f"{name} {remainder} D={d}: ranks ended at {steps}"
                row[f"D={d}"] = {"steps": steps[0], "emitted": emitted, "lost": total - emitted}
            if remainder == "pad":
                row["cost"] = cost(plan, src, ops)
            out[f"{name} {remainder}"] = row
            print(name, remainder, json.dumps(row))
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

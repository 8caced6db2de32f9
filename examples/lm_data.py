"""The data the two LM examples share (lm_torch_ddp.py, lm_jax_flax.py): two JSONL corpora, a
tokenizer, and the Zephon pipeline that feeds them to a model.

- `write_data`: real code (the Python standard library's own sources) and generated English-like
  prose as two JSONL files, and a byte-level BPE trained on them in-process (no hub).
- `lm_pipeline`: Zephon mixes the two 60/40 *by tokens* inside every lane, tokenizes each
  document (`Tokenize`, EOS appended) and packs rows of `--seq-len` tokens (`Pack(..., "concat")`:
  no padding, no token lost), with a short batch-size warm-up by tokens (`--ramp-from` rows a step
  until `--ramp-tokens` tokens were seen, then `--batch`). It returns the loader arguments, for any emitter:
  `JaxLoader(lm_pipeline(out, args), zephon.Where(mesh=...))`, `ZephonIterableDataset(lm_pipeline(out, args))`.
- `eval_pipeline`: the held-out evaluation set (code files and prose documents not trained on),
  a *finite* plan read whole (`Mix(..., stop="all")`), packed, its last steps padded
  (`remainder="pad"`): every held-out token is scored exactly once, at any number of ranks.
  `evaluate` turns its batches into the mean token loss, scoring each row alone and summing
  exactly (`math.fsum`), so the loss is the same at every data-parallel degree.
- `add_data_args`: the command-line flags both examples take for them.

`python examples/lm_….py` puts examples/ on sys.path, so the examples import this module by name.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import zephon as z
from zephon.demo.textdata import EOS_ID, generate_corpus, python_stdlib_corpus, train_bpe, write_jsonl
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.sources import JsonlSource


def add_data_args(ap: argparse.ArgumentParser, batch_help: str) -> None:
    """--batch, --ramp-from, --ramp-tokens, --lanes, --seq-len, --vocab, --code-every, --prose-docs."""
    ap.add_argument("--batch", type=int, default=16, help=batch_help)
    ap.add_argument("--ramp-from", type=int, default=None,
                    help="rows a step during the batch-size warm-up (default: half of --batch, a multiple of --lanes)")
    ap.add_argument("--ramp-tokens", type=int, default=None,
                    help="tokens of the warm-up before --batch rows a step (default: 2 steps' worth; 0: no warm-up)")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--code-every", type=int, default=6, help="use every n-th stdlib file")
    ap.add_argument("--prose-docs", type=int, default=600)
    ap.add_argument("--eval-docs", type=int, default=24, help="held-out documents per corpus")


def write_data(out: Path, args: argparse.Namespace) -> None:
    """Two JSONL corpora and a tokenizer.json in `out` (done once, before any loader starts)."""
    code = [t for t in python_stdlib_corpus() if 200 <= len(t) <= 20_000][::args.code_every]
    prose = generate_corpus(args.prose_docs, seed=1)
    write_jsonl(out / "code.jsonl", code, field="source")
    write_jsonl(out / "prose.jsonl", prose)
    train_bpe(code + prose, vocab_size=args.vocab).save(str(out / "tokenizer.json"))
    # held out: stdlib files between the training ones, prose from another seed
    files = [t for t in python_stdlib_corpus() if 200 <= len(t) <= 20_000]
    held = [t for i, t in enumerate(files) if i % args.code_every][:args.eval_docs]
    write_jsonl(out / "eval_code.jsonl", held, field="source")
    write_jsonl(out / "eval_prose.jsonl", generate_corpus(args.eval_docs, seed=3))


def describe_batches(plan: z.Batching, seq_len: int) -> str:
    """The plan's batch sizes, for the log: `8 rows until 2,048 tokens (step 2), then 16`."""
    stretches = plan.sizes.stretches()
    parts = [f"{b} rows" + (f" from step {k} ({plan.tokens_before(k, seq_len):,} tokens)" if k else "")
             for k, b in stretches]
    return ", then ".join(parts)


def lm_pipeline(out: Path, args: argparse.Namespace) -> z.Pipeline:
    """The packed, mixed LM pipeline over `write_data`'s files: plan, sources, packing and
    per-source tokenizers, one `zephon.Pipeline` every loader takes."""
    code, prose = JsonlSource(str(out / "code.jsonl")), JsonlSource(str(out / "prose.jsonl"))
    lanes = z.Mix([z.Source(len(code), id=0).shuffle(seed=1).repeat(),
                   z.Source(len(prose), id=1).shuffle(seed=2).repeat()],
                  [0.6, 0.4], by="tokens").lanes(args.lanes)
    small = args.ramp_from or max(args.lanes, args.batch // 2 // args.lanes * args.lanes)
    tokens = 2 * small * args.seq_len if args.ramp_tokens is None else args.ramp_tokens
    if tokens and small < args.batch:  # a warm-up: the batch size is part of the plan
        plan = lanes.batch(schedule=((0, small), (tokens, args.batch)), by="tokens", seq_len=args.seq_len)
    else:
        plan = lanes.batch(args.batch)
    tokenizer = str(out / "tokenizer.json")
    return z.Pipeline(plan, [code, prose], [Pack(args.seq_len, "concat")],
                      per_source={0: [Tokenize(tokenizer, field="source", eos=EOS_ID)],
                                  1: [Tokenize(tokenizer, field="text", eos=EOS_ID)]})


def eval_pipeline(out: Path, args: argparse.Namespace) -> z.Pipeline:
    """The held-out set as a finite plan: both files read whole (60/40 by tokens while both
    last), tokenized, packed like training, the last steps padded — a `zephon.Pipeline`."""
    code, prose = JsonlSource(str(out / "eval_code.jsonl")), JsonlSource(str(out / "eval_prose.jsonl"))
    plan = z.Mix([z.Source(len(code), id=0), z.Source(len(prose), id=1)], [0.6, 0.4], by="tokens",
                 stop="all").lanes(args.lanes).batch(args.batch, remainder="pad")
    tokenizer = str(out / "tokenizer.json")
    return z.Pipeline(plan, [code, prose], [Pack(args.seq_len, "concat")],
                      per_source={0: [Tokenize(tokenizer, field="source", eos=EOS_ID)],
                                  1: [Tokenize(tokenizer, field="text", eos=EOS_ID)]})


RowLoss = Callable[[Mapping[str, np.ndarray]], np.ndarray]


def row_losses(batch: Mapping[str, Any], row_loss: RowLoss) -> list[float]:
    """The masked token losses of a batch's valid rows, each row scored alone (`row_loss` gets
    one row as arrays of shape [1, seq_len] and returns its token losses): no result can depend
    on how many rows, ranks or devices share a batch."""
    data = {k: np.asarray(v) for k, v in batch.items()}
    out: list[float] = []
    for r in np.flatnonzero(data["valid"]):
        row = {k: v[r:r + 1] for k, v in data.items()}
        mask = row["loss_mask"][0].astype(bool)
        out += np.asarray(row_loss(row), np.float64).reshape(-1)[mask].tolist()
    return out


def evaluate(batches: Iterable[Mapping[str, Any]], row_loss: RowLoss) -> tuple[float, int]:
    """(mean token loss, tokens scored) over a finite evaluation loader's batches; padding rows
    (`valid` False) are skipped, and the sum is exact (`math.fsum`), so the order rows come in
    — one rank or eight — changes nothing."""
    losses = [x for b in batches for x in row_losses(b, row_loss)]
    return math.fsum(losses) / max(1, len(losses)), len(losses)

"""Zephon's side of the packing benchmark (`benchmarks/pack.py` finds `zephon_rows` here).

The same texts and tokenizer as the Grain rows: texts in memory, a global shuffle repeated
forever, 8 lanes, `Tokenize` (no BOS/EOS, like the baselines) then `Pack(seq_len, mode)`; the
runner computes tokenization windows ahead. Nothing is truncated, so `tokens_lost` is 0 by
construction and the tests prove it (tests/test_lm.py).

Runner "processes cache=0" turns off Tokenize's pre-token cache (`zephon.ops.pretokens`): the
tokenizer's own `encode_batch` then does all the work, as in the Grain rows, so the pipelines are
compared on equal tokenizing cost. pack.py keeps it out of the headline rows (it is a reference).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

RUNNERS = ("inline", "threads", "processes", "processes cache=0")


def _stream(loader: Any) -> Iterator[dict[str, Any]]:
    try:
        for batch in loader:
            yield batch.data
    finally:
        loader.close()


def zephon_rows(texts: list[str], tokenizer: Any, seq_len: int, batch: int, mode: str,
                runner: str) -> dict[str, Any]:
    from pack import measure_stream  # benchmarks/ is on sys.path when pack.py runs

    from zephon import How, Loader, Pipeline, Source
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.runners import from_spec
    from zephon.sources.memory import ArraySource

    col = np.empty(len(texts), dtype=object)
    col[:] = texts
    lanes = 8 if batch % 8 == 0 else 1
    plan = Source(len(texts)).shuffle(7).repeat().lanes(lanes).batch(batch)
    name, _, cache = runner.partition(" cache=")
    run = None if name == "inline" else from_spec(name if ":" in name else name + ":2")
    tokenize = Tokenize(tokenizer) if not cache else Tokenize(tokenizer, cache=int(cache))
    loader = Loader(Pipeline(plan, ArraySource({"text": col}), [tokenize, Pack(seq_len, mode)]), how=How(runner=run))
    out = measure_stream(_stream(loader))
    return {**out, "tokens_lost": 0.0}

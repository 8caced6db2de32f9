"""The one pretraining pipeline both trainer integrations build: text files → tokens → mix → pack.

TorchTitan and Megatron-LM each get their rows from it, so the two differ only in how a batch
is laid out for the trainer. The plan is `Mix([Source(n_i).shuffle().repeat()], weights,
by="tokens").lanes(L).batch(B)`: every lane follows the mixture, documents are packed per lane
(concat-then-split by default), and positions restart at every document.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zephon.errors import PlanError
from zephon.ops.pack import Pack
from zephon.ops.tokenize import Tokenize
from zephon.pipeline import Pipeline
from zephon.plan import Batching, Source
from zephon.plan.mix import Mix
from zephon.sources.base import RecordSource


@dataclass(frozen=True)
class TextPipeline:
    """What a `zephon.Loader` needs for packed, mixed pretraining text: plan, sources, operators."""

    plan: Batching
    sources: list[RecordSource]
    transforms: list[Any]
    per_source: dict[int, list[Any]]

    def pipeline(self) -> Pipeline:
        """The `zephon.Pipeline` every loader of it reads (seeded through the plan's shuffles)."""
        return Pipeline(self.plan, self.sources, tuple(self.transforms),
                        per_source={k: tuple(v) for k, v in self.per_source.items()})


def open_text_source(path: str) -> RecordSource:
    """A JSONL (`.jsonl`, `.json`, `.jsonl.gz`...) or Parquet (`.parquet`) file or glob."""
    name = Path(path).name.lower()
    if ".parquet" in name:
        from zephon.sources.parquet import ParquetSource

        return ParquetSource(path)
    if ".json" in name:
        from zephon.sources.jsonl import JsonlSource

        return JsonlSource(path)
    raise PlanError(f"cannot tell the format of data file {path!r}: name JSONL files *.jsonl and "
                    "Parquet files *.parquet (other sources: build the zephon.Loader yourself and "
                    "pass it as `pipeline=`).")


def text_pipeline(*, paths: Sequence[str], fields: Sequence[str] | str, weights: Sequence[float] | None,
                  tokenizer: Any, bos: int | None, eos: int | None, seq_len: int, global_batch: int,
                  lanes: int, seed: int, infinite: bool, pack_mode: str = "concat",
                  tokenizer_name: str | None = None, mapping: str = "contiguous") -> TextPipeline:
    """Tokenize + mix by tokens + pack over `paths` (one source each); see the module doc."""
    if not paths:
        raise PlanError("no data files: give one or more JSONL/Parquet paths (one mixture component each).")
    n = len(paths)
    names = [fields] * n if isinstance(fields, str) else list(fields)
    if len(names) != n:
        raise PlanError(f"{len(names)} text fields for {n} data files: give one field, or one per file.")
    w = [1.0] * n if not weights else [float(x) for x in weights]
    if len(w) != n or any(x <= 0 for x in w):
        raise PlanError(f"weights {list(w)} must be {n} positive numbers, one per data file.")
    if global_batch % lanes:
        raise PlanError(f"global batch {global_batch} is not a multiple of lanes={lanes}; choose lanes "
                        "dividing the global batch (and divisible by every data-parallel size you "
                        "will run at).")
    sources = [open_text_source(p) for p in paths]
    children = []
    for i, src in enumerate(sources):
        node = Source(len(src), id=i).shuffle(seed + i)
        children.append(node.repeat() if infinite else node)
    mixed = Mix(children, w, by="tokens") if n > 1 else children[0]
    plan = mixed.lanes(lanes, mapping).batch(global_batch)  # type: ignore[arg-type]
    extra: dict[str, Any] = {} if tokenizer_name is None else {"name": tokenizer_name}
    per_source = {i: [Tokenize(tokenizer, field=names[i], bos=bos, eos=eos, **extra)] for i in range(n)}
    return TextPipeline(plan, sources, [Pack(seq_len, pack_mode)], per_source)  # type: ignore[arg-type]

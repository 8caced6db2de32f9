"""Per-domain accounting: which source every row (or packed token) came from, as batch fields.

A training loop that mixes corpora wants loss and token counts per domain. The loader knows
each row's provenance (`LocalBatch.refs`, or for packed rows `segments`: the document pieces in
segment order), so with `Loader(..., domains=True)` it adds small numeric fields that every
emitter carries like any other (numpy arrays, sharded `jax.Array`s, torch tensors), cut by
micro-batches with the rows:

- `source_id`: packed rows: per token, the source of its document (-1 on padding), shape
  `(rows, seq_len)` — multiply a per-token loss by `source_id == d` for domain `d`'s loss;
  unpacked rows: per row, shape `(rows,)`.
- `tokens_by_source` (packed rows): `(rows, sources)` tokens of each source in the row.
- `trained_by_source` (packed rows): `(rows, sources)` tokens of each source whose loss mask
  is 1 (`loss_mask`, or MaxText's `targets_segmentation`) — what `Mix(by="trained_tokens")`
  balances.

`sources` is the plan's largest `Source.id` + 1, so the shape is the same at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zephon.errors import PlanError
from zephon.plan import Refs
from zephon.sources.base import Columns

FIELDS = ("source_id", "tokens_by_source", "trained_by_source")


def domain_fields(cols: Columns, refs: Refs | None, segments: Sequence[Sequence[tuple[int, ...]]] | None,
                  sources: int) -> Columns:
    """The accounting fields of a batch's rows (see the module doc)."""
    clash = [k for k in FIELDS if k in cols]
    if clash:
        raise PlanError(f"the batch already has a field {clash[0]!r}; Loader(domains=True) adds it. "
                        "Rename the pipeline's field.")
    if segments is None:
        if refs is None:
            return {}
        return {"source_id": refs.source.astype(np.int32)}
    seg = cols.get("segment_ids", cols.get("inputs_segmentation"))
    if seg is None or seg.ndim != 2:
        raise PlanError("Loader(domains=True) on rows an accumulator built needs their per-token "
                        "segment ids (Pack's segment_ids or inputs_segmentation).")
    rows = seg.shape[0]
    lut = np.full((rows, max((len(r) for r in segments), default=0) + 1), -1, np.int64)
    for r, row in enumerate(segments):
        lut[r, 1:len(row) + 1] = [s[0] for s in row]
    seg = seg.astype(np.int64, copy=False)
    if seg.size and (seg.min() < 0 or seg.max() >= lut.shape[1]):
        raise PlanError("segment ids do not match the rows' provenance (more segments than pieces); "
                        "Loader(domains=True) needs Pack's rows.")
    src = np.take_along_axis(lut, seg, axis=1)
    real = src >= 0
    idx = (np.arange(rows)[:, None] * sources + src)[real]
    out = {"source_id": src.astype(np.int32),
           "tokens_by_source": np.bincount(idx, minlength=rows * sources).reshape(rows, sources).astype(np.int32)}
    mask = cols.get("loss_mask", cols.get("targets_segmentation"))
    if mask is not None:
        w = (np.asarray(mask) != 0)[real]
        out["trained_by_source"] = (np.bincount(idx, weights=w, minlength=rows * sources)
                                    .reshape(rows, sources).astype(np.int32))
    return out

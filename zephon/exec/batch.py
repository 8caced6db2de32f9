"""`LocalBatch`: the rows of one global batch a process owns, their provenance and micro-batches.

What `Loader` yields. Its rows are the owned lanes' rows in lane order; `explain()` names each
row's record (or, for packed rows, its document pieces); `micro_batches(n)` cuts the rows into `n`
equal consecutive blocks for gradient accumulation. The micro-batch count check lives here, in
the core, so every emitter (numpy, JAX, torch) refuses a count with the same message.

Terms (docs/glossary.md): local batch, micro-batch, batch.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zephon.errors import PlanError, check_positive_int, divisors
from zephon.plan import Refs
from zephon.sources.base import Columns


def check_micro_count(n: Any, rows: int, what: str = "this process's batch") -> int:
    """`n` as an int, if it splits `rows` rows evenly; otherwise a PlanError listing those that do."""
    n = check_positive_int(n, "n of micro_batches(n)")
    if rows % n:
        raise PlanError(f"micro_batches({n}) cannot split the {rows} rows of {what} into equal "
                        f"micro-batches; use n in {divisors(rows)} (a micro-batch count that divides "
                        "the rows every data-parallel rank holds).")
    return n


@dataclass(frozen=True)
class LocalBatch:
    """The rows of global batch `step` that this process owns, in global row order.

    `refs` names each row's record (one-to-one and filter pipelines); `segments`, for rows an
    accumulator built, lists per row its pieces as (source, record, epoch, start, stop).
    `micro` is `(i, n)` when this is micro-batch `i` of `n` of the step (see `micro_batches`):
    it then holds the `i`-th of `n` equal consecutive blocks of the owned rows.

    It reads like a mapping of its `data`, as every emitter's batch does (`JaxBatch`,
    `TorchBatch` and the Grain-compatible loader's are dicts): `batch["tokens"]`, `"tokens" in
    batch`, `batch.keys()`, `batch.items()`, `batch.get(name)`, `dict(batch)`, and iterating
    gives the field names. It has no `len()` (a field count would read as a row count: see
    `rows`), so a batch is always truthy.
    """

    step: int
    data: Columns
    lanes: np.ndarray
    rows_per_lane: int
    global_rows: int
    refs: Refs | None = None
    segments: list[list[tuple[int, int, int, int, int]]] | None = None
    micro: tuple[int, int] = (0, 1)

    # --- a read-only mapping of `data` ---------------------------------------------------------
    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.data[name]
        except KeyError:
            raise KeyError(f"this batch has no field {name!r}; its fields are {sorted(self.data)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.data

    def __iter__(self) -> Iterator[str]:
        """The field names, as iterating a dict gives its keys."""
        return iter(self.data)

    def keys(self) -> KeysView[str]:
        return self.data.keys()

    def values(self) -> ValuesView[np.ndarray]:
        return self.data.values()

    def items(self) -> ItemsView[str, np.ndarray]:
        return self.data.items()

    def get(self, name: str, default: Any = None) -> Any:
        return self.data.get(name, default)

    @property
    def rows(self) -> int:
        """How many rows this batch holds."""
        return len(self.lanes) * self.rows_per_lane // self.micro[1]

    def lane_slice(self, k: int) -> slice:
        """Rows of the k-th owned lane within `data` (of a micro-batch: the part of it held here)."""
        start, n = self.micro[0] * self.rows, self.rows
        return slice(min(max(k * self.rows_per_lane - start, 0), n),
                     min(max((k + 1) * self.rows_per_lane - start, 0), n))

    def global_shape(self, name: str) -> tuple[int, ...]:
        return (self.global_rows // self.micro[1],) + tuple(self.data[name].shape[1:])

    @property
    def contiguous(self) -> bool:
        """Whether the owned rows form one contiguous block of the global batch."""
        return bool(np.all(np.diff(self.lanes) == 1))

    @property
    def row_offset(self) -> int:
        """First global row of this process's rows (contiguous ownership)."""
        return int(self.lanes[0]) * self.rows_per_lane // self.micro[1] if len(self.lanes) else 0

    def explain(self) -> list[dict[str, Any]]:
        """Per row: its global row in the step's batch, lane and where its data came from."""
        out: list[dict[str, Any]] = []
        start = self.micro[0] * self.rows
        for j in range(self.rows):
            lane, k = int(self.lanes[(start + j) // self.rows_per_lane]), (start + j) % self.rows_per_lane
            row: dict[str, Any] = {"row": lane * self.rows_per_lane + k, "lane": lane}
            if self.segments is not None:
                row["segments"] = [{"source": s, "record": r, "epoch": e, "tokens": [a, b]}
                                   for s, r, e, a, b in self.segments[j]]
            elif self.refs is not None:
                row.update(source=int(self.refs.source[j]), record=int(self.refs.record[j]),
                           epoch=int(self.refs.epoch[j]))
            out.append(row)
        return out

    def micro_batches(self, n: int) -> list[LocalBatch]:
        """`n` micro-batches for gradient accumulation: equal, consecutive blocks of the rows
        (views, no copy), `refs` and `segments` cut with them.

        Micro-batch `i` holds rows `[i*R/n, (i+1)*R/n)` of this process's `R` rows, so
        concatenating the micro-batches field by field, in order, gives the batch back, whatever
        `n` — and changing `n`, also at a resume, changes nothing that is loaded. `n` must divide
        `R` (a PlanError lists the counts that do).
        """
        n = check_micro_count(n, self.rows)
        m = self.rows // n
        out = []
        for i in range(n):
            cut = slice(i * m, (i + 1) * m)
            out.append(replace(self, data={k: v[cut] for k, v in self.data.items()},
                               refs=None if self.refs is None else self.refs.take(cut),
                               segments=None if self.segments is None else self.segments[cut],
                               micro=(self.micro[0] * n + i, self.micro[1] * n)))
        return out


__all__ = ["LocalBatch", "check_micro_count"]

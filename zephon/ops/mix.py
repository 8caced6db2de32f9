"""Per-source pipelines before a mix.

Each corpus of a mix usually needs its own preparation — its text field, its tokenizer, its
filter. `PerSource` runs a chain of row operators on the rows of each source id (rows keep their
order), so the sources can arrive in different schemas as long as their chains end in one.
The mixing itself is the plan's `Mix` node: by samples it is part of the index algebra (O(1)
random access, applied inside every lane); by tokens the lane engine schedules it
(`zephon.exec.lanes`), with the lane's token counts in its state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.ops.base import Transform, run_transforms
from zephon.plan import Refs
from zephon.sources.base import Columns


@dataclass(frozen=True)
class PerSource(Transform):
    """`{source id: (row operators...)}`: each source's rows through its own chain."""

    chains: Mapping[int, tuple[Transform, ...]]

    @property
    def one_to_one(self) -> bool:  # type: ignore[override]
        return all(t.one_to_one for chain in self.chains.values() for t in chain)

    @property
    def expands(self) -> bool:  # type: ignore[override]
        return any(t.expands for chain in self.chains.values() for t in chain)

    @property
    def op_name(self) -> str:
        return "PerSource"

    def config(self) -> dict[str, Any]:
        return {str(k): [t.checked_identity() for t in chain] for k, chain in sorted(self.chains.items())}

    def identity(self) -> dict[str, Any]:
        return {"name": self.op_name, "version": self.version,
                "config": {str(k): [t.identity() for t in chain] for k, chain in sorted(self.chains.items())}}

    def apply(self, cols: Columns, refs: Refs, seed: int) -> tuple[Columns, np.ndarray]:
        n = len(refs)
        ids = np.unique(refs.source)
        if all(int(i) not in self.chains for i in ids):
            return cols, np.arange(n)
        parts: list[tuple[np.ndarray, Columns]] = []
        for sid in ids:
            rows = np.flatnonzero(refs.source == sid)
            sub = {k: v[rows] for k, v in cols.items()}
            chain = self.chains.get(int(sid), ())
            if chain:
                sub, kept = run_transforms(chain, sub, refs.take(rows), seed)
                rows = rows[kept]
            parts.append((rows, sub))
        src = np.concatenate([r for r, _ in parts])
        order = np.argsort(src, kind="stable")
        names = set(parts[0][1])
        for _, sub in parts[1:]:
            if set(sub) != names:
                raise PlanError(f"sources give different fields after their own pipelines "
                                f"({sorted(names)} vs {sorted(sub)}); end every per-source chain in "
                                "one schema.")
        out: Columns = {}
        for k in names:
            vs = [sub[k] for _, sub in parts]
            if any(v.dtype == object for v in vs):
                vs = [v.astype(object) if v.dtype != object else v for v in vs]
            try:
                out[k] = np.concatenate(vs)[order]
            except ValueError as e:
                raise PlanError(f"field {k!r} differs in shape between sources "
                                f"({[str(v.dtype) + str(v.shape[1:]) for v in vs]}); map every source "
                                "to one schema.") from e
        return out, src[order]

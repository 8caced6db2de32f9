"""The pipeline as the lane engine sees it: row operators, one accumulator, operators after it.

Row operators carry nothing and run in parallel over windows; the accumulator (packing) runs in
lane order; what follows it must keep one output per input, so it cannot move a step boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.ops.base import Accumulator, Transform


@dataclass(frozen=True)
class LanePipeline:
    """Row operators (parallel), an optional accumulator and one-to-one operators after it."""

    rows: tuple[Transform, ...]
    acc: Accumulator | None = None
    post: tuple[Transform, ...] = ()

    @staticmethod
    def split(ops: Sequence[Any], per_source: Mapping[int, Sequence[Transform]] | None = None) -> LanePipeline:
        """The pipeline of `ops`, after a `PerSource` of `per_source`'s row operators if given."""
        ops = tuple(ops)
        if per_source:
            from zephon.ops.mix import PerSource

            bad = [k for k in per_source if isinstance(k, bool) or not isinstance(k, (int, np.integer))]
            if bad:
                raise PlanError(f"per_source is keyed by Source id (an int), got keys {bad[:4]}")
            ops = (PerSource({int(k): tuple(v) for k, v in per_source.items()}),) + ops
        rows: list[Transform] = []
        acc: Accumulator | None = None
        post: list[Transform] = []
        for op in ops:
            if isinstance(op, Accumulator):
                if acc is not None:
                    raise PlanError(f"a pipeline may hold one accumulator; got {acc.op_name} and "
                                    f"{op.op_name}. Fold them into one operator.")
                acc = op
            elif isinstance(op, Transform):
                if acc is not None and not op.one_to_one:
                    raise PlanError(f"{op.op_name} changes the number of rows after the accumulator "
                                    f"{acc.op_name}; only one-to-one operators may follow it. Move "
                                    "it before the accumulator.")
                (post if acc is not None else rows).append(op)
            else:
                raise PlanError(f"{op!r} is not a lane operator; use zephon.Map/Filter/FlatMap/"
                                "RandomMap, a Transform or an Accumulator subclass.")
        return LanePipeline(tuple(rows), acc, tuple(post))

    @property
    def ops(self) -> tuple[Any, ...]:
        return self.rows + ((self.acc,) if self.acc is not None else ()) + self.post

    @property
    def one_to_one(self) -> bool:
        return self.acc is None and all(t.one_to_one for t in self.rows)

    @property
    def expands(self) -> bool:
        return any(t.expands for t in self.rows)

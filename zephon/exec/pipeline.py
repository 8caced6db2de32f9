"""The pipeline as the lane engine sees it: row operators, one accumulator, operators after it.

Row operators carry nothing and run in parallel over windows; the accumulator (packing) runs in
lane order; what follows it must keep one output per input, so it cannot move a step boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zephon.errors import PlanError
from zephon.ops.base import Accumulator, Transform


@dataclass(frozen=True)
class LanePipeline:
    """Row operators (parallel), an optional accumulator and one-to-one operators after it."""

    rows: tuple[Transform, ...]
    acc: Accumulator | None = None
    post: tuple[Transform, ...] = ()

    @staticmethod
    def split(ops: Sequence[Any]) -> LanePipeline:
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

"""The sample index algebra: which record sits at every row of every global batch.

A plan is a tree of small frozen nodes, one module a concept. The stream nodes (`Source`,
`Shuffle`, `BlockShuffle`, `Repeat`, `Mix`, `Slice`) map an array of stream positions to record
references (`Refs`: source, record, epoch) with vectorised integer math, in O(len(positions)) time
and O(1) memory in the data set size. `Lanes` deals the stream into canonical lanes, the unit of
state and of data-parallel ownership, and the root `Batching` lays `size / lanes` outputs of every
lane side by side, lane-major. Because every rank of every data-parallel degree `D` (with
`lanes % D == 0`) reads its rows from the same lanes, the global batch is a function of the plan
and the step only.

Plans are JSON: `to_json`/`from_json` round-trip and `fingerprint()` hashes the canonical form,
so a checkpoint can prove which plan wrote it.

Modules: `node` (the contract: kind registry, JSON, fingerprint, shared checks), `refs`,
`source`, `shuffle`, `blockshuffle`, `repeat`, `slice`, `mix`, `lanes`, `batching` (the root),
`batchsizes` (batch-size schedules), `permute` (keyed Feistel bijections), `walk` (tree walks),
`diff` (`plan_diff`), `quality` (how well a plan shuffles), `jsondoc` (JSON text → object).
Importing this package imports every node module, so the kind registry is complete.
"""

from __future__ import annotations

from typing import Any

from zephon.errors import deprecated_attribute
from zephon.plan.batching import Batching
from zephon.plan.blockshuffle import BlockShuffle
from zephon.plan.diff import plan_diff
from zephon.plan.lanes import Lanes, check_degree
from zephon.plan.mix import Mix
from zephon.plan.node import MAX_POSITION, Mapping, Node, PassThrough
from zephon.plan.refs import Refs
from zephon.plan.repeat import Repeat
from zephon.plan.shuffle import Shuffle
from zephon.plan.slice import Slice, skip, take
from zephon.plan.source import Source

__all__ = ["MAX_POSITION", "Batching", "BlockShuffle", "Lanes", "Mapping", "Mix", "Node", "PassThrough",
           "Plan", "Refs", "Repeat", "Shuffle", "Slice", "Source", "check_degree", "plan_diff"]

Plan = Batching
"""A complete plan is its root `Batching` node."""

#: Names kept for one version: old name -> (the object, what to use instead).
DEPRECATED: dict[str, tuple[Any, str]] = {
    "Batch": (Batching, "zephon.Batching (the plan's root node; `stream.lanes(L).batch(B)` builds it)"),
    "Take": (take, "stream.take(n)"),
    "Skip": (skip, "stream.skip(n)"),
}


def __getattr__(name: str) -> Any:
    return deprecated_attribute(__name__, name, DEPRECATED)

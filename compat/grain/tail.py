"""The part of a Grain pipeline after Zephon's plan: partial batches, `batch_fn`, steps after
`batch`, and Grain's iterator-only datasets.

Zephon's plan ends in the global batch, full batches only. Grain code goes further: a smaller
last batch (`drop_remainder=False`), `batch(batch_fn=...)`, `map`/`filter`/slicing after `batch`,
thread prefetch, `device_put`, flat maps, window shuffles. `split` cuts a pipeline in two: the
head, the longest prefix the plan runs (so its elements keep every Zephon guarantee: Grain's
order, lanes, the JSON state), and the tail, Grain's own semantics on the head's output —
random access (`item`, `length`) as Grain's `MapDataset`s compute it, including indices past
the end (the next epoch), and iteration as Grain's iterators (`streams`). What the tail costs:
it runs in the consuming thread in Python, on whole elements; `shard()`/`to_jax()` need the
plan's batch (`Dataset` refuses them with a tail and says so).
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grain

from zephon.errors import PlanError

from .compile import GRAIN_INFINITE, GraphOp
from .order import grain_proportions
from .streams import (
    BatchStep,
    FilterStep,
    FlatMapStep,
    InterleaveStep,
    MapStep,
    MixStep,
    PrefetchStep,
    WindowShuffleStep,
    make_batch,
)
from .transforms import grain_map_rng

TAIL_LEAVES = ("iter_mix", "interleave", "external")
"""Grain iterator datasets that start a pipeline (their inputs are whole datasets, in args)."""
TAIL_ONLY = ("prefetch", "flat_map", "window_shuffle", "flat_map_map", "repeat_same", "iter_nones",
             *TAIL_LEAVES)
"""Steps the plan does not run: a pipeline containing one is run by the tail."""
TAIL_ITER = tuple(k for k in TAIL_ONLY if k not in ("flat_map_map", "repeat_same"))
"""The tail steps that make the pipeline an IterDataset."""

MAP_STEPS = ("map", "filter", "random_map", "map_with_index", "slice", "batch", "flat_map_map",
             "repeat_same")
_BY_INDEX = ("slice", "repeat_same")  # MapDataset steps whose iteration needs Grain's indices


def chain(op: GraphOp) -> list[GraphOp]:
    """The pipeline's linear chain, source side first (a mix/source/iterator leaf starts it)."""
    out = [op]
    while len(out[-1].parents) == 1:
        out.append(out[-1].parents[0])
    return out[::-1]


def fn_of(kind: str, t: Any) -> Callable[..., Any]:
    """The callable behind a Grain transform object or a plain function."""
    if kind == "map" and isinstance(t, grain.transforms.Map):
        return t.map
    if kind == "filter" and isinstance(t, grain.transforms.Filter):
        return t.filter
    if kind == "random_map" and isinstance(t, grain.transforms.RandomMap):
        return t.random_map
    if kind == "map_with_index" and isinstance(t, grain.transforms.MapWithIndex):
        return t.map_with_index
    if kind == "flat_map" and hasattr(t, "flat_map"):
        return t.flat_map
    return t


@dataclass(frozen=True)
class Split:
    """`head`: the op the plan runs up to (None: the pipeline starts with a tail-only leaf);
    `tail`: the steps after it, source side first."""

    head: GraphOp | None
    tail: tuple[GraphOp, ...]


def split(op: GraphOp, stream_length: Callable[[GraphOp], int | None], packed: bool) -> Split:
    """Cuts the pipeline after the last step the plan can run with Grain's semantics."""
    ops = chain(op)
    if ops[0].kind in TAIL_LEAVES:
        return Split(None, tuple(ops))
    for i, o in enumerate(ops):
        if o.kind in TAIL_ONLY:
            return Split(ops[i - 1], tuple(ops[i:]))
        if o.kind == "batch":
            if packed or _plan_batch(o, stream_length):
                rest = ops[i + 1:]
                while rest and rest[0].kind == "to_iter_dataset":
                    o, rest = rest[0], rest[1:]
                return Split(o, tuple(rest))
            return Split(ops[i - 1], tuple(ops[i:]))
    return Split(op, ())


def _plan_batch(batch: GraphOp, stream_length: Callable[[GraphOp], int | None]) -> bool:
    """Whether the plan's global batch gives Grain's batches: no batch_fn, and no smaller last
    batch (dropped, none, or an infinite stream without a filter)."""
    a = batch.args
    if a.get("batch_fn") is not None:
        return False
    if a["drop_remainder"] or a.get("schedule"):
        return True  # (a batch-size schedule is the plan's: full batches only)
    parent = batch.parents[0]
    if any(o.kind == "filter" for o in parent.upstream()):
        return False
    n = stream_length(parent)
    return n is None or n == GRAIN_INFINITE or n % a["batch_size"] == 0


def _map_prefix(tail: Sequence[GraphOp], head_is_map: bool) -> int:
    """How many leading tail steps are MapDataset steps (random access)."""
    n = 0
    while head_is_map and n < len(tail) and tail[n].kind in MAP_STEPS:
        n += 1
    return n


class Tail:
    """Grain's semantics for the steps after the head (random access and iteration)."""

    def __init__(self, ops: Sequence[GraphOp], head_len: Callable[[], int],
                 head_item: Callable[[int], Any], head_iter: Callable[[], Any],
                 head_is_map: bool, leaf: Callable[[GraphOp], Any]) -> None:
        self.ops = tuple(ops)
        self._head_len, self._head_item, self._head_iter = head_len, head_item, head_iter
        self.map_prefix = _map_prefix(self.ops, head_is_map)
        self.random_access = self.map_prefix == len(self.ops)
        self._leaf = leaf

    # --- MapDataset semantics ---------------------------------------------------------------
    def length(self, upto: int | None = None) -> int:
        ops = self.ops[:upto] if upto is not None else self.ops
        if len(ops) > self.map_prefix:
            raise TypeError("this pipeline ends in a Grain IterDataset step; it has no len() "
                            "(as in Grain).")
        n = self._head_len()
        for o in ops:
            if o.kind == "slice":
                n = len(builtins.range(n)[o.args["slice"]])
            elif o.kind == "batch":
                bs = o.args["batch_size"]
                n = n // bs if o.args["drop_remainder"] else math.ceil(n / bs)
            elif o.kind == "repeat_same":
                epochs = o.args["num_epochs"]
                n = GRAIN_INFINITE if epochs is None or n * epochs >= GRAIN_INFINITE else n * epochs
            elif o.kind == "flat_map_map":
                fan = o.args["transform"].max_fan_out
                n = GRAIN_INFINITE if n >= GRAIN_INFINITE / fan else fan * n
        return n

    def item(self, index: int, upto: int | None = None) -> Any:
        """Element `index` as Grain's MapDataset computes it (past the end: the next epoch)."""
        k = len(self.ops) if upto is None else upto
        if k == 0:
            return self._head_item(index)
        o = self.ops[k - 1]
        a = o.args
        if o.kind == "slice":
            start, _, step = a["slice"].indices(self.length(k - 1))
            return self.item(start + index * step, k - 1)
        if o.kind == "batch":
            n, parent_n, bs = self.length(k), self.length(k - 1), a["batch_size"]
            epoch, i = divmod(index, n)
            start, stop = i * bs, min(parent_n, (i + 1) * bs)
            values = [self.item(j + epoch * parent_n, k - 1) for j in builtins.range(start, stop)]
            return (a.get("batch_fn") or make_batch)(values)
        if o.kind == "repeat_same":
            return self.item(index % self.length(k - 1), k - 1)
        if o.kind == "flat_map_map":
            element, slot = divmod(index, a["transform"].max_fan_out)
            parent = self.item(element, k - 1)
            splits = None if parent is None else _splits(a["transform"], parent)
            return splits[slot] if splits is not None and slot < len(splits) else None
        e = self.item(index, k - 1)
        if e is None:
            return None
        f = fn_of(o.kind, a["transform"])
        if o.kind == "map":
            return f(e)
        if o.kind == "filter":
            return e if f(e) else None
        if o.kind == "map_with_index":
            return f(index, e)
        if o.kind == "random_map":
            return f(e, grain_map_rng(a["seed"], index))
        raise PlanError(f"{o.kind} has no random access")

    # --- IterDataset semantics --------------------------------------------------------------
    def iterator(self) -> Any:
        ops = list(self.ops)
        nones = self.map_prefix < len(ops) and ops[self.map_prefix].kind == "iter_nones"
        if nones or any(o.kind in _BY_INDEX for o in ops[:self.map_prefix]):
            # Grain's indices (slices, repeats of epoch 0, kept Nones): read element by element
            it = IndexIterator(self, self.map_prefix, keep_nones=nones)
            ops = ops[self.map_prefix + nones:]
        else:
            it = self._head_iter()
        for o in ops:
            it = self._step(it, o)
        return it

    def _step(self, it: Any, o: GraphOp) -> Any:
        a, k = o.args, o.kind
        if k in ("map", "filter", "flat_map"):
            f = fn_of(k, a["transform"])
            return {"map": MapStep, "filter": FilterStep, "flat_map": FlatMapStep}[k](it, f)
        if k == "flat_map_map":  # iterating Grain's MapDataset skips the unused slots' Nones
            t = a["transform"]
            return FlatMapStep(it, lambda e: _splits(t, e))
        if k == "batch":
            return BatchStep(it, a["batch_size"], a["drop_remainder"], a.get("batch_fn"))
        if k == "prefetch":
            return PrefetchStep(it, a["size"])
        if k == "window_shuffle":
            return WindowShuffleStep(it, a["window_size"], a["seed"])
        if k in ("to_iter_dataset", "seed"):
            return it
        if k == "iter_mix":
            return MixStep([iter(d) for d in a["datasets"]],
                           grain_proportions(a["weights"], len(a["datasets"])))
        if k == "interleave":
            return InterleaveStep(a["datasets"], a["cycle_length"])
        if k == "external":
            return self._leaf(o)
        raise PlanError(f"{k} cannot follow a step the plan does not run (after batch with "
                        "batch_fn/a partial last batch, or after a Grain iterator step); move it "
                        "before batch().")


def _splits(transform: Any, element: Any) -> list[Any]:
    splits = list(transform.flat_map(element))
    if len(splits) > transform.max_fan_out:
        raise ValueError(f"the FlatMapTransform made {len(splits)} elements, more than its "
                         f"max_fan_out={transform.max_fan_out}; raise max_fan_out (as in Grain).")
    return splits


class IndexIterator(grain.DatasetIterator):
    """Iterates a random-access tail by index as Grain's MapDataset does (Nones skipped);
    its state is the next index."""

    def __init__(self, tail: Tail, upto: int, *, keep_nones: bool = False) -> None:
        super().__init__()
        self.tail, self.upto, self.index, self.n = tail, upto, 0, tail.length(upto)
        self.keep_nones = keep_nones

    def __next__(self) -> Any:
        while self.index < self.n:
            e = self.tail.item(self.index, self.upto)
            self.index += 1
            if e is not None or self.keep_nones:
                return e
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        self.index = int(state["next_index"])

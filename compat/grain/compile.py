"""Grain-shaped pipeline graph -> Zephon plan and transforms (and back to real Grain).

A `Dataset` records the steps a Grain user writes as a small graph of `_Op` nodes, mirroring the
nodes Grain would create. `compile_pipeline` turns it into a Zephon plan (`Batching(Lanes(...))`)
and a chain of row operators: in `order="grain"` shuffles, mixes and Grain indices become the
Grain-order nodes of `order`, so the plan names Grain's records; in `order="zephon"` Zephon's own
`Shuffle`/`Mix`. `to_grain` builds the same graph with real Grain.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grain
import numpy as np

from zephon.errors import PlanError
from zephon.ops.base import Operator, Transform
from zephon.ops.pack import Pack
from zephon.plan import Batching, Mix, Node, Repeat, Shuffle, Slice, Source
from zephon.plan import Mapping as LaneMapping
from zephon.runners.base import Runner

from .order import GRAIN_INFINITE, ContiguousBatches, GrainIndex, GrainMix, GrainShuffle, grain_proportions
from .packing import GrainPackNames, PackInput
from .sources import GrainSource, RecordsOf, is_zephon_source
from .transforms import (
    Branches,
    GrainFilter,
    GrainMap,
    GrainMapWithIndex,
    GrainRandomMap,
    GrainTransform,
    LaneOp,
    has_accumulator,
    with_collate,
)

log = logging.getLogger("zephon.compat.grain")

Order = str  # "grain" | "zephon"

READ_AHEAD = 2048
"""Rows a compat loader reads (and transforms) ahead in one group. Grain records pass through
Python transforms record by record, so large group reads buy little and cost latency: the first
batch, and every restore, waits for the whole group."""

def _is_lane_op(t: Any) -> bool:
    """A Zephon row operator (Tokenize, zephon.Map/Filter/FlatMap/RandomMap, any Transform) that
    is not one of this package's own transforms."""
    return isinstance(t, Transform) and not isinstance(t, GrainTransform)


@dataclass(frozen=True, eq=False)
class _Op:
    """One node of the Grain-shaped pipeline; mirrors the node Grain would create."""

    kind: str
    parents: tuple[_Op, ...] = ()
    args: Mapping[str, Any] = field(default_factory=dict)

    def default_seed(self) -> int | None:
        """Grain's `_default_seed`: a SeedSequence over (seed, depth) of the nearest `.seed()`s."""
        agg: list[int] = []
        todo: list[tuple[_Op, int]] = [(self, 0)]
        while todo:
            node, depth = todo.pop(0)
            if node.kind == "seed":
                agg.extend((int(node.args["seed"]), depth))
            else:
                todo.extend((p, depth + 1) for p in node.parents)
        if not agg:
            return None
        return int(np.random.SeedSequence(agg).generate_state(1, dtype=np.uint32)[0])

    def upstream(self) -> Iterable[_Op]:
        yield self
        for p in self.parents:
            yield from p.upstream()


@dataclass(frozen=True)
class _Config:
    order: Order = "grain"
    lanes: int | None = None
    mapping: LaneMapping = "contiguous"
    rank: int | None = None  # None: not sharded (rank 0 of 1; backends may derive their own)
    world: int | None = None
    runner: Runner | None = None
    read_ahead: int = READ_AHEAD


@dataclass
class _Ctx:
    order: Order
    wrap_columnar: bool
    sources: list[Any] = field(default_factory=list)
    tags: int = 0
    count_field: str = "tokens"  # what a mix by tokens counts (the packed feature, if packing)

    def tag(self) -> int:
        self.tags += 1
        return self.tags - 1


@dataclass(frozen=True)
class _Built:
    node: Node
    chain: tuple[Operator, ...] = ()  # row operators, then (packing) an accumulator and more
    filtered: bool = False
    sources: tuple[int, ...] = ()


def _build(op: _Op, ctx: _Ctx) -> _Built:
    k, a = op.kind, op.args
    if k == "source":
        sid = len(ctx.sources)
        src = a["source"]
        if is_zephon_source(src):
            ctx.sources.append(RecordsOf(src) if ctx.wrap_columnar else src)
        else:
            ctx.sources.append(GrainSource(src))
        return _Built(Source(len(src), sid, a.get("name", "")), sources=(sid,))
    if k == "batch":
        raise PlanError("`batch` must be the last step of the pipeline: Zephon emits fixed-size "
                        "global batches; move it to the end (map batches inside your step fn).")
    if k == "mix":
        kids = [_build(p, ctx) for p in op.parents]
        props = grain_proportions(a["weights"], len(kids))
        mixed: Node
        if a.get("by", "samples") in ("tokens", "trained_tokens"):
            mixed = Mix(tuple(c.node for c in kids), tuple(float(p) for p in props), by=a["by"],
                        count_field=a.get("count_field") or ctx.count_field,
                        schedule=a.get("schedule", ()))
        elif ctx.order == "grain":
            mixed = GrainMix(tuple(c.node for c in kids), props)
        else:
            if any(isinstance(n, GrainIndex) for c in kids for n in _nodes(c.node)):
                raise PlanError("map_with_index/random_map before mix needs order='grain' (Zephon's "
                                "Mix does not carry Grain indices); apply it after mix instead.")
            mixed = Mix(tuple(c.node for c in kids), tuple(float(p) for p in props))
        branch_chain: tuple[Operator, ...] = ()
        if any(c.chain for c in kids):
            branch_chain = (Branches(tuple((c.sources, row_ops(c.chain)) for c in kids)),)
        return _Built(mixed, branch_chain, any(c.filtered for c in kids),
                      tuple(s for c in kids for s in c.sources))
    b = _build(op.parents[0], ctx)
    if k in ("seed", "to_iter_dataset"):
        return b
    if k == "shuffle":
        shuffled: Node = GrainShuffle(b.node, a["seed"]) if ctx.order == "grain" else Shuffle(b.node, a["seed"])
        return replace(b, node=shuffled)
    if k == "repeat":
        return replace(b, node=Repeat(b.node, a["num_epochs"]))
    if k == "slice":
        n = b.node.length
        start, stop, step = a["slice"].indices(GRAIN_INFINITE if n is None else n)
        if step < 1:
            raise PlanError(f"slice step must be positive for a Zephon plan, got {step}")
        stop = None if n is None and stop >= GRAIN_INFINITE else stop
        return replace(b, node=Slice(b.node, start, stop, step))
    packed = has_accumulator(b.chain)
    if k in ("map", "filter") and isinstance(a["transform"], Transform):
        t = a["transform"]
        lane_op = LaneOp(t) if _is_lane_op(t) else t  # compat's own adapters pass through
        return replace(b, chain=b.chain + (lane_op,), filtered=b.filtered or not t.one_to_one)
    if k == "map":
        return replace(b, chain=b.chain + (GrainMap(a["transform"]),))
    if k == "filter":
        return replace(b, chain=b.chain + (GrainFilter(a["transform"]),), filtered=True)
    if k == "pack":
        if packed:
            raise PlanError("a pipeline packs once: it already has a packing step (one accumulator "
                            "per lane pipeline).")
        pack: Pack = a["pack"]
        chain = b.chain + (PackInput(a["fields"], keep=a.get("grain") is None and a.get("names") is None), pack)
        if a.get("names") == "grain":
            chain += (GrainPackNames(a["fields"]),)
        return replace(b, chain=chain)
    if packed and k in ("random_map", "map_with_index") and ctx.order == "grain":
        raise PlanError(f"{k} after a packing step: packed rows have no Grain index; apply it "
                        "before packing, or use order='zephon' (a generator per packed row).")
    if k in ("random_map", "map_with_index"):
        if a.get("iter") and b.filtered and ctx.order == "grain":
            raise PlanError(f"{k} after to_iter_dataset() numbers elements by how many survived "
                            "earlier filters, which Zephon's lanes cannot reproduce; apply it before "
                            "the filter (or before to_iter_dataset()), or use order='zephon'.")
        if k == "random_map" and ctx.order != "grain":
            return replace(b, chain=b.chain + (GrainRandomMap(a["transform"], a["seed"], "record"),))
        tag = ctx.tag()
        indexed: Transform = (GrainRandomMap(a["transform"], a["seed"], "dataset", tag) if k == "random_map"
                              else GrainMapWithIndex(a["transform"], tag))
        return replace(b, node=GrainIndex(b.node, tag), chain=b.chain + (indexed,))
    raise PlanError(f"unknown pipeline step {k!r}")


def row_ops(chain: Sequence[Operator]) -> tuple[Transform, ...]:
    """A chain without a packing step, as row operators (`Dataset` refuses a mix after packing;
    its callers check `has_accumulator` first)."""
    rows = tuple(t for t in chain if isinstance(t, Transform))
    if len(rows) != len(chain):
        raise PlanError("this step cannot follow a packing step; move it before (as in Grain).")
    return rows


def _nodes(node: Node) -> Iterable[Node]:
    yield node
    for c in getattr(node, "children", None) or ((node.child,) if hasattr(node, "child") else ()):
        yield from _nodes(c)


@dataclass(frozen=True)
class _Compiled:
    plan: Batching
    stream: Node  # the Grain-ordered element stream (before lanes are dealt)
    sources: dict[int, Any]
    transforms: tuple[Operator, ...]


def _largest_divisor(n: int, upto: int) -> int:
    return max(d for d in range(1, upto + 1) if n % d == 0)


def compile_pipeline(op: _Op, config: _Config) -> _Compiled:
    """The plan, element stream, sources and transforms of the pipeline ending in `op`."""
    while op.kind == "to_iter_dataset" and op.parents and op.parents[0].kind == "batch":
        op = op.parents[0]
    batched = op.kind == "batch"
    size, drop = (op.args["batch_size"], op.args["drop_remainder"]) if batched else (None, True)
    stream_op = op.parents[0] if op.kind == "batch" else op
    leaves = sum(1 for o in stream_op.upstream() if o.kind == "source")
    sample_mix = any(o.kind == "mix" and o.args.get("by", "samples") == "samples"
                     for o in stream_op.upstream())
    ctx = _Ctx(config.order, wrap_columnar=leaves > 1 and sample_mix)
    packs = [o for o in stream_op.upstream() if o.kind == "pack"]
    if packs:
        ctx.count_field = packs[0].args["fields"][0]
    built = _build(stream_op, ctx)
    token_mix = any(isinstance(n, Mix) and n.by_tokens for n in _nodes(built.node))
    if token_mix and not (isinstance(built.node, Mix) and built.node.by_tokens):
        raise PlanError("a mix by tokens runs inside every lane, so it must be the last ordering "
                        "step of the pipeline: shuffle/repeat/slice each dataset before mix(), "
                        "and apply map_with_index/random_map (Grain-indexed) before it too.")
    lane_engine = token_mix or has_accumulator(built.chain)
    lanes = config.lanes or config.world or 1
    rows = size if size is not None else lanes
    if rows % lanes:
        raise PlanError(f"batch size {rows} is not divisible by lanes={lanes}; choose a lane "
                        f"count that divides the batch (e.g. lanes({_largest_divisor(rows, lanes)})).")
    n = built.node.length
    if size is not None and n is not None and n % size and not drop and not lane_engine:
        log.warning("the stream has %d elements, not a multiple of batch size %d: Zephon emits "
                    "full global batches only, so the last %d elements are not emitted (Grain "
                    "would emit a smaller final batch).", n, size, n % size)
    if built.filtered and lanes > 1 and config.order == "grain" and not lane_engine:
        log.warning("with a filter and lanes=%d each lane filters its own input, so batches "
                    "differ from Grain's (which fills one batch from the whole stream); use "
                    "lanes=1 to compare with Grain.", lanes)
    stream = built.node
    schedule = op.args.get("schedule", ()) if batched else ()
    if schedule and config.order == "grain":
        raise PlanError("a batch-size schedule has no Grain order: Grain batches with one size. "
                        "Build it with Dataset.source(..., order='zephon') to use batch(schedule=...).")
    if config.order == "grain" and lanes > 1 and not lane_engine:
        # each lane's rows of a step are consecutive Grain elements (Grain's batches); a
        # packing or token-mixed lane consumes documents at its own pace, so it just reads
        # its share of the Grain-ordered stream
        stream = ContiguousBatches(stream, lanes, rows // lanes)
    # Grain's end (partial batches, drop_remainder) is the tail's: the plan drops
    plan = Batching(stream.lanes(lanes, config.mapping), rows, schedule, remainder="drop")
    transforms = with_collate(built.chain) if size is not None else built.chain
    return _Compiled(plan, built.node, dict(enumerate(ctx.sources)), transforms)


def to_grain(op: _Op, memo: dict[int, Any]) -> Any:
    if id(op) in memo:
        return memo[id(op)]
    k, a = op.kind, op.args
    if k == "source":
        src = a["source"]
        if is_zephon_source(src):
            raise PlanError("to_grain() needs Grain data sources; a Zephon RecordSource has no "
                            "Grain equivalent.")
        ds = grain.MapDataset.range(src.start, src.stop, src.step) if isinstance(src, range) else (
            grain.MapDataset.source(src))
    elif k == "mix":
        if a.get("by", "samples") != "samples":
            raise PlanError("to_grain(): Grain has no mix by tokens.")
        ds = grain.MapDataset.mix([to_grain(p, memo) for p in op.parents], a["weights"])
    else:
        p = to_grain(op.parents[0], memo)
        if k == "seed":
            ds = p.seed(a["seed"])
        elif k == "shuffle":
            ds = p.shuffle(seed=a["seed"])
        elif k in ("repeat", "repeat_same"):
            ds = p.repeat(a["num_epochs"], reseed_each_epoch=k == "repeat")
        elif k == "slice":
            ds = p.slice(a["slice"])
        elif k in ("map", "filter") and isinstance(a["transform"], Transform):
            raise PlanError(f"to_grain(): the Zephon operator {a['transform'].op_name} has no Grain "
                            "equivalent (tokenize with a Grain map to compare with Grain).")
        elif k == "map":
            ds = p.map(a["transform"])
        elif k == "filter":
            ds = p.filter(a["transform"])
        elif k == "pack":
            if a.get("grain") is None:
                raise PlanError("to_grain(): a zephon Pack given to map() has no Grain equivalent; "
                                "spell the packing step with zephon.compat.grain.experimental's "
                                "Grain packers.")
            cls_name, kwargs = a["grain"]
            if isinstance(p, grain.MapDataset):
                p = p.to_iter_dataset()
            ds = getattr(grain.experimental, cls_name)(p, **kwargs)
        elif k == "random_map":
            ds = p.random_map(a["transform"], seed=a["seed"])
        elif k == "map_with_index":
            ds = p.map_with_index(a["transform"])
        elif k in ("to_iter_dataset", "iter_nones"):
            ds = p.to_iter_dataset(allow_nones=k == "iter_nones")
        elif k == "batch":
            if isinstance(p, grain.MapDataset) and any(o.kind == "filter" for o in op.upstream()):
                p = p.to_iter_dataset()  # Grain requires this after filter; same elements
            if a.get("schedule"):
                raise PlanError("Grain has no batch-size schedule; compare a pipeline with one batch size.")
            ds = p.batch(a["batch_size"], drop_remainder=a["drop_remainder"], batch_fn=a.get("batch_fn"))
        else:
            raise PlanError(f"no Grain equivalent for step {k!r}")
    memo[id(op)] = ds
    return ds

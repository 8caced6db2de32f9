"""`Pipeline`, `Where`, `How`: the one value every entry point takes, and its two option groups.

A pipeline is *what* a run reads — the plan, the record sources, the lane operators, the
per-source operators and the seed — and it alone decides every global batch. *Where* a loader
runs (its data-parallel rank of how many, or a device mesh; which lanes it owns) and *how* it
runs (runner, read-ahead, telemetry, prefetch) change where rows are materialised and how fast,
never which rows: that is Zephon's guarantee, and keeping the three apart is what lets `zephon
verify` run one `Pipeline` under many `Where`s and `How`s and compare the batches.

    import numpy as np
    import zephon as z
    from zephon.sources import ArraySource

    pipe = z.Pipeline(z.Source(1000).shuffle(seed=0).repeat().lanes(8).batch(32),
                      ArraySource({"x": np.arange(1000)}), seed=0)
    loader = z.Loader(pipe, where=z.Where(rank=0, world=2), how=z.How(read_ahead=256))
    batch = next(loader)
    batch["x"].shape                 # (16,): rank 0's half of global batch 0
    pipe.fingerprint()               # what `zephon explain` and `zephon verify` print

Every front door — `zephon.Loader` (numpy), `zephon.backends.jax.JaxLoader`,
`zephon.backends.torch.TorchLoader` / `ZephonIterableDataset` — takes `(pipeline, where=,
how=)`; the old forms `Loader(plan, sources, transforms, rank=..., runner=...)` keep working
for one version with a `DeprecationWarning` naming the new form (`split_old_form`).
Terms: docs/glossary.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import PlanError, check_positive_int
from zephon.telemetry import Telemetry

if TYPE_CHECKING:  # annotations only: the runners and the loader import the core, not this
    from zephon.exec.loader import Loader
    from zephon.runners.base import Runner
    from zephon.sources.base import RecordSource

__all__ = ["Call", "How", "Pipeline", "Where", "no_rest", "read_call", "split_old_form", "split_old_options"]

AllGather = Callable[[list[int]], list[list[int]]]


def _source_map(sources: Any) -> dict[int, Any]:
    """`{Source id: record source}` from one source, a list (index = id) or a mapping."""
    if isinstance(sources, Mapping):
        bad = [k for k in sources if isinstance(k, bool) or not isinstance(k, (int, np.integer))]
        if bad:
            raise PlanError(f"sources are keyed by Source id (an int), got keys {bad[:4]}")
        return {int(k): v for k, v in sources.items()}
    if isinstance(sources, (list, tuple)):
        return dict(enumerate(sources))
    return {0: sources}


@dataclass(frozen=True, eq=False)
class Pipeline:
    """What a run reads: `plan` over `sources`, through `ops` (and `per_source` ops), seeded.

    Args:
      plan: a complete plan, ending in `.lanes(L).batch(B)`.
      sources: one record source, a list (index = `Source.id`) or a mapping id -> source.
      ops: lane operators applied in every lane, in order: row operators (`Map`, `RandomMap`,
        `Filter`, `FlatMap`, `Tokenize`, ...), at most one accumulator (`Pack`), then one-to-one
        operators.
      per_source: `{Source id: [row operators]}` applied to that source's rows first — each
        corpus of a mix its own text field, tokenizer or filter.
      seed: seeds data-derived randomness (`RandomMap`, crops, flips); part of the identity.

    Its identity (`describe()`, `fingerprint()`) is what a checkpoint records: the plan's
    fingerprint, the seed and every operator's name, version and config. Record sources are
    not part of it (a plan names each source's size; the bytes are the sources' business).
    """

    plan: Any
    sources: Mapping[int, RecordSource] | Any
    ops: Sequence[Any] = ()  # any sequence; held as a tuple
    per_source: Mapping[int, tuple[Any, ...]] | None = None
    seed: int = 0
    #: a Grain-compatible pipeline's own loader class and `Dataset` (`zephon.compat.grain`)
    loader_cls: type | None = field(default=None, repr=False)
    dataset: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from zephon.plan import Batching  # the plan algebra; imported here to keep this module light

        if not isinstance(self.plan, Batching):
            raise PlanError(f"Loader needs a complete plan: stream.lanes(L).batch(B) (a Pipeline's plan; "
                            f"got {type(self.plan).__name__}).")
        object.__setattr__(self, "seed", _non_negative(self.seed, "seed"))
        if isinstance(self.ops, (str, bytes)) or not isinstance(self.ops, Sequence):
            raise PlanError(f"Pipeline(ops=...) is a sequence of lane operators, got {type(self.ops).__name__}")
        object.__setattr__(self, "sources", _source_map(self.sources))
        object.__setattr__(self, "ops", tuple(self.ops))
        if self.per_source is not None:
            object.__setattr__(self, "per_source", {k: tuple(v) for k, v in self.per_source.items()})

    @property
    def transforms(self) -> Sequence[Any]:
        """Deprecated: the old name of `ops` (zephon.testing.Pipeline's third field)."""
        warnings.warn(_TRANSFORMS_DEPRECATED.format("pipeline.transforms", "pipeline.ops"), DeprecationWarning,
                      stacklevel=2)
        return self.ops

    def lane_ops(self) -> tuple[Any, ...]:
        """The operators every lane runs: a `PerSource` of `per_source` first, then `ops`."""
        from zephon.exec.pipeline import LanePipeline

        return LanePipeline.split(self.ops, self.per_source).ops

    def describe(self) -> dict[str, Any]:
        """The pipeline as JSON: plan, seed, operators' identities, sources' types and sizes."""
        return {"plan": self.plan.to_json(), "plan_fingerprint": self.plan.fingerprint(), "seed": self.seed,
                "ops": [op.identity() for op in self.lane_ops()],
                "sources": {str(k): {"type": type(v).__name__, "records": _len(v)}
                            for k, v in sorted(self.sources.items())}}

    def fingerprint(self) -> str:
        """SHA-256 (hex, first 16 bytes) of plan fingerprint, seed and operator identities."""
        ident = {k: v for k, v in self.describe().items() if k in ("plan_fingerprint", "seed", "ops")}
        text = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def replace(self, **changes: Any) -> Pipeline:
        """A copy with `changes` (e.g. `pipe.replace(seed=1)`)."""
        return dataclasses.replace(self, **changes)

    def loader(self, where: Where | None = None, how: How | None = None, **options: Any) -> Loader:
        """A numpy `zephon.Loader` of this pipeline (its own loader class for Grain pipelines).

        The old `loader(rank=, world=, runner=, ...)` (zephon.testing.Pipeline's) works for this
        version with a DeprecationWarning naming the new form."""
        where, how, options = split_old_options("pipeline.loader", where, how, options)
        if self.loader_cls is not None:
            return self.loader_cls(self, where=where, how=how, **options)
        import zephon  # the public face: zephon.exec.loader imports this module, so not back

        return zephon.Loader(self, where=where, how=how, **options)


_TRANSFORMS_DEPRECATED = ("{} is deprecated and will be removed in the next version; use {} (ops is the old "
                          "transforms' new name).")


def _accept_transforms(init: Callable[..., None]) -> Callable[..., None]:
    """The dataclass's `__init__`, also taking `transforms=` (the old name of `ops`, as
    `zephon.testing.Pipeline(plan, sources, transforms=...)` spelled it) for one version."""

    @functools.wraps(init)
    def __init__(self: Pipeline, *args: Any, transforms: Any = None, **kwargs: Any) -> None:
        if transforms is not None:
            if len(args) > 2 or "ops" in kwargs:
                raise TypeError("Pipeline() got both ops and transforms (its old name); pass ops only.")
            warnings.warn(_TRANSFORMS_DEPRECATED.format("Pipeline(plan, sources, transforms=...)",
                                                        "zephon.Pipeline(plan, sources, ops)"),
                          DeprecationWarning, stacklevel=2)
            kwargs["ops"] = transforms
        init(self, *args, **kwargs)

    return __init__


Pipeline.__init__ = _accept_transforms(Pipeline.__init__)  # type: ignore[method-assign]


def _non_negative(v: Any, what: str, minimum: int = 0) -> int:
    """`v` as an int >= minimum (numpy integers too), else a PlanError naming `what`."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise PlanError(f"Loader({what}=...) must be a {'positive' if minimum else 'non-negative'} integer, "
                        f"got {v!r}")
    return int(v)


def _len(source: Any) -> int | None:
    try:
        return len(source)
    except TypeError:
        return None


@dataclass(frozen=True, eq=False)
class Where:
    """Where a loader runs: its data-parallel rank of `world`, or a device mesh.

    Args:
      rank, world: this process's data-parallel rank and degree (`plan.lanes.count % world ==
        0`). None: the runtime's (`torch.distributed`, `jax.process_index()`), else 0 of 1.
      mesh: a `jax.sharding.Mesh` or a torch `DeviceMesh`; the batch dim is split over
        `batch_axes` (mesh axis names; JAX's default "data") and rank/world follow from it.
      sharding: JAX only, instead of mesh/batch_axes: a `NamedSharding` for every field, or a
        mapping field -> `NamedSharding`.
      group: torch only: the process group rank and world come from (default: the world group).
      lanes: produce only these of the rank's lanes (how DataLoader workers split a rank's lanes).
      all_gather: `[ints] -> every rank's [ints]` through the runtime in use: how ranks agree on
        a finite count-changing plan's end without each counting every lane.
    """

    rank: int | None = None
    world: int | None = None
    mesh: Any = None
    batch_axes: str | tuple[str, ...] | None = None
    sharding: Any = None
    group: Any = None
    lanes: tuple[int, ...] | None = None
    all_gather: AllGather | None = None

    def __post_init__(self) -> None:
        for what in ("rank", "world"):
            v = getattr(self, what)
            if v is not None:
                object.__setattr__(self, what, _non_negative(v, what, minimum=int(what == "world")))
        if self.rank is not None and self.world is not None and self.rank >= self.world:
            raise PlanError(f"Where(rank={self.rank}, world={self.world}): rank must be < world")
        if self.mesh is not None and (self.rank is not None or self.world is not None or self.group is not None):
            raise PlanError("pass either mesh or rank/world/group, not both: with a mesh they follow from it")
        if self.lanes is not None:
            object.__setattr__(self, "lanes", tuple(int(l) for l in self.lanes))

    def rank_world(self) -> tuple[int, int]:
        """(rank, world) with None read as 0 of 1 (the numpy loader has no runtime to ask)."""
        return (0 if self.rank is None else self.rank), (1 if self.world is None else self.world)


@dataclass(frozen=True, eq=False)
class How:
    """How a loader runs: none of these change the data, only speed, memory and reporting.

    Args:
      runner: `zephon.runners.inline()` (default), `threads(n)` or `processes(n)`: computes
        steps (or lane windows) ahead in parallel. The loader's `close()` closes it.
      read_ahead: rows one read aims for (default: the smallest `read_ahead_rows` hint of the
        operators, else `zephon.exec.steps.READ_AHEAD_ROWS`, 16384).
      telemetry: True, False, or a `zephon.Telemetry(log_every=..., progress=...)`: what
        `stats()` reports (stall, stage times, throughput).
      prefetch: batches an emitter prepares ahead (JAX: on device; torch DataLoader: per worker).
      micro_batches: the micro-batch count the training loop will cut every batch into; checked
        against every batch size of the plan's schedule when the loader starts.
      domains: add per-domain accounting fields to every batch (`source_id`, and for packed rows
        `tokens_by_source`, `trained_by_source`; see `zephon.exec.accounting`).
    """

    runner: Runner | None = None
    read_ahead: int | None = None
    telemetry: bool | Telemetry = True
    prefetch: int = 2
    micro_batches: int | None = None
    domains: bool = False

    def __post_init__(self) -> None:
        if self.read_ahead is not None:
            check_positive_int(self.read_ahead, "How(read_ahead=...)")
        if self.micro_batches is not None:
            check_positive_int(self.micro_batches, "How(micro_batches=...)")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise PlanError(f"How(prefetch=...) must be a non-negative integer (batches ahead), got {self.prefetch!r}")
        if not isinstance(self.telemetry, (bool, Telemetry)):
            raise PlanError(f"How(telemetry=...) is True, False or a zephon.Telemetry, got {self.telemetry!r}")


_PIPELINE_KEYS = ("per_source", "seed")
_WHERE_KEYS = tuple(f.name for f in dataclasses.fields(Where))
_HOW_KEYS = tuple(f.name for f in dataclasses.fields(How))


def split_old_form(entry: str, plan: Any, sources: Any, transforms: Any, options: dict[str, Any],
                   *, renames: Mapping[str, str] | None = None, stacklevel: int = 3
                   ) -> tuple[Pipeline, Where, How, dict[str, Any]]:
    """The deprecated `entry(plan, sources, transforms, **options)` as `(pipeline, where, how,
    rest)`, with one `DeprecationWarning` naming the new form; `rest` is what belongs to neither
    group (e.g. `start_step`, an emitter's own options). `renames` maps an old keyword to its
    new name (torch's `mesh_dims` -> `batch_axes`)."""
    opts = {(renames or {}).get(k, k): v for k, v in options.items()}
    pk = {k: opts.pop(k) for k in _PIPELINE_KEYS if k in opts}
    wk = {k: opts.pop(k) for k in _WHERE_KEYS if k in opts}
    hk = {k: opts.pop(k) for k in _HOW_KEYS if k in opts}
    parts = [f"{k}=..." for k in pk]
    new = (f"{entry}(zephon.Pipeline(plan, sources, ops{''.join(', ' + p for p in parts)})"
           + (f", where=zephon.Where({', '.join(f'{k}=...' for k in wk)})" if wk else "")
           + (f", how=zephon.How({', '.join(f'{k}=...' for k in hk)})" if hk else "") + ")")
    warnings.warn(f"{entry}(plan, sources, transforms, ...) is deprecated and will be removed in the next "
                  f"version; use {new}.", DeprecationWarning, stacklevel=stacklevel)
    pipe = Pipeline(plan, sources, tuple(transforms or ()), **pk)
    return pipe, Where(**wk), How(**hk), opts


def split_old_options(entry: str, where: Where | None, how: How | None, options: dict[str, Any],
                      *, stacklevel: int = 3) -> tuple[Where | None, How | None, dict[str, Any]]:
    """The option-group keywords of an old call form (`entry(..., rank=, runner=, ...)`) folded
    into `where` and `how`, with one DeprecationWarning naming the new form; returns `(where,
    how, rest)`, `rest` being what belongs to neither group (e.g. `start_step`)."""
    wk = {k: v for k, v in options.items() if k in _WHERE_KEYS}
    hk = {k: v for k, v in options.items() if k in _HOW_KEYS}
    if not wk and not hk:
        return where, how, options
    if (wk and where is not None) or (hk and how is not None):
        raise TypeError(f"{entry}(): pass where=zephon.Where(...) / how=zephon.How(...) or the old keywords "
                        f"{sorted({**wk, **hk})}, not both")
    new = ", ".join([f"where=zephon.Where({', '.join(f'{k}=...' for k in wk)})"] * bool(wk)
                    + [f"how=zephon.How({', '.join(f'{k}=...' for k in hk)})"] * bool(hk))
    warnings.warn(f"{entry}({', '.join(f'{k}=...' for k in {**wk, **hk})}) is deprecated and will be removed in "
                  f"the next version; use {entry}({new}).", DeprecationWarning, stacklevel=stacklevel)
    rest = {k: v for k, v in options.items() if k not in wk and k not in hk}
    return (Where(**wk) if wk else where), (How(**hk) if hk else how), rest


_GROUPS = (("zephon.Where", frozenset(_WHERE_KEYS)), ("zephon.How", frozenset(_HOW_KEYS)),
           ("zephon.Pipeline", frozenset(("seed", "per_source", "sources", "plan", "transforms"))))


@dataclass(frozen=True)
class Call:
    """A front door's arguments, read: the pipeline, its two option groups, and the door's own
    keyword arguments the old form passed among the loader's (`rest`)."""

    pipeline: Pipeline
    where: Where
    how: How
    rest: dict[str, Any]


def read_call(entry: str, pipeline: Any, where: Any, how: Any, old_form: dict[str, Any], *,
              renames: Mapping[str, str] | None = None) -> Call:
    """A front door's arguments (`zephon.Loader`'s and the backends'): `entry(pipeline, where,
    how)`, or the deprecated `entry(plan, sources, transforms, **options)` (also with `plan=`,
    `sources=`, `transforms=` as keywords) split into the groups by `split_old_form`, which
    warns naming the new form at the caller's line."""
    if not isinstance(pipeline, Pipeline):
        if pipeline is None and "plan" in old_form:
            pipeline = old_form.pop("plan")
        if where is None and "sources" in old_form:
            where = old_form.pop("sources")
        transforms = old_form.pop("transforms", how)
        if pipeline is None:
            raise PlanError(f"{entry} needs a zephon.Pipeline(plan, sources, ops): what it reads.")
        # the warning names the line that called the door: split_old_form <- here <- door <- caller
        pipe, w, h, rest = split_old_form(entry, pipeline, where, transforms, old_form, renames=renames,
                                          stacklevel=4)
        return Call(pipe, w, h, rest)
    if old_form:
        hints = []
        for key in sorted(old_form):
            key = (renames or {}).get(key, key)
            group = next((g for g, keys in _GROUPS if key in keys), None)
            hints.append(f"{key} goes in {group}" if group else f"{key} is not an option of {entry}")
        raise TypeError(f"{entry}(pipeline, where=, how=) got unexpected keyword arguments "
                        f"{sorted(old_form)}: {'; '.join(hints)}.")
    where = Where() if where is None else where
    how = How() if how is None else how
    for what, v, cls in (("where", where, Where), ("how", how, How)):
        if not isinstance(v, cls):
            raise PlanError(f"{entry}({what}=...) takes a zephon.{cls.__name__}, got {type(v).__name__}")
    return Call(pipeline, where, how, {})


def no_rest(entry: str, rest: Mapping[str, Any]) -> None:
    """A TypeError naming old-form keyword arguments that belong to no group and not to the door."""
    if rest:
        raise TypeError(f"{entry}() got unexpected keyword arguments {sorted(rest)}")

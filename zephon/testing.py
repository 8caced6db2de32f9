"""Prove Zephon's guarantee on your own pipeline: one-call assertions and the configuration matrix.

You write a *factory*: a function that builds your pipeline and returns a `Pipeline` (or
`(plan, sources[, transforms])`, a dict of `Pipeline`'s fields, or a `zephon.compat.grain.Dataset`).
It may take `world=` (and `rank=`) if your code reads the data-parallel degree: then a pipeline
that changes with the degree is caught too. A factory given as `"module:function"` or
`"path/to/file.py:function"` is imported by name, which multi-process runs need.

Then, in a test::

    from zephon import testing as zt

    def test_my_pipeline_is_deterministic():
        zt.assert_elastic(my_factory)                      # D = 1, 2, 4, 8 give the same batches
        zt.assert_runners_agree(my_factory)                # threads / processes change nothing
        zt.assert_emitters_agree(my_factory)               # numpy, JAX, torch, the Grain API
        zt.assert_resumes(my_factory)                      # stop, save, resume at another D
        zt.assert_micro_batches(my_factory, counts=(2, 4)) # gradient accumulation views

or with the pytest plugin (`@pytest.mark.zephon_pipeline(factory)` and the `zephon_verify`
fixture), or from the shell: `zephon verify module:factory`.

Every check runs configurations of your pipeline and compares each global step, lane by lane,
with the reference — the numpy emitter at D=1 — by digests of every row. A failure raises
`DeterminismError` naming the first step, lane, row and field that differ, with `explain` of
that row (its source, record, epoch — or the document pieces of a packed row).

A configuration is written like `numpy D=2 runner=threads:2`, `jax mesh=2x4 micro=2`,
`torch D=4 workers=2`, `grain D=2`, `jax procs=2 mesh=2x4` (two local processes under
`jax.distributed`), `torch procs=2` (gloo), and with stops: `numpy D=2 @10 -> torch D=8`
(10 steps at D=2, the state saved through that emitter's API, JSON round-tripped, merged over
ranks and restored by the next). See `Config.parse`.

This module is numpy-only at import; it imports JAX, torch and Grain only for the
configurations that use them.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from zephon.errors import PlanError, ZephonError
from zephon.exec.loader import Loader, LocalBatch, merge_states
from zephon.plan import Batch, Node
from zephon.verify import (Divergence, LaneRecord, Report, RunResult, StepRecord, compare_steps,
                           describe_row, lane_records, record_fingerprint)

BACKENDS = ("numpy", "jax", "torch", "grain")
_FAKE_DEVICES = "--xla_force_host_platform_device_count"


class DeterminismError(AssertionError):
    """A configuration of the pipeline produced other batches than the reference."""


class FactoryError(ZephonError, ValueError):
    """The pipeline factory cannot be found, imported or called, or returned something else."""


# --- the pipeline under test ----------------------------------------------------------------------

@dataclass(frozen=True)
class Pipeline:
    """What a factory returns: the arguments of `zephon.Loader`.

    `loader_cls` is the loader class (a `zephon.compat.grain` pipeline uses its own); `dataset`
    keeps the Grain-shaped `Dataset` a pipeline came from.
    """

    plan: Batch
    sources: Any
    transforms: Sequence[Any] = ()
    per_source: Mapping[int, Sequence[Any]] | None = None
    seed: int = 0
    loader_cls: type = Loader
    dataset: Any = None

    def loader(self, *, rank: int = 0, world: int = 1, runner: Any = None, **options: Any) -> Loader:
        """A loader of this pipeline for data-parallel rank `rank` of `world`."""
        kw = dict(options)
        if self.per_source:
            kw["per_source"] = self.per_source
        return self.loader_cls(self.plan, self.sources, tuple(self.transforms), seed=self.seed,
                               rank=rank, world=world, runner=runner, **kw)

    def backend_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `JaxLoader` / `TorchLoader` / `ZephonIterableDataset`."""
        kw: dict[str, Any] = {"seed": self.seed}
        if self.per_source:
            kw["per_source"] = self.per_source
        return kw

    def backend_refusal(self) -> str | None:
        """Why the JAX/torch emitters cannot carry this pipeline, or None."""
        if self.loader_cls is not Loader and not all(getattr(t, "one_to_one", True) for t in self.transforms):
            return ("a zephon.compat.grain pipeline with a filter yields Grain records that only its "
                    "own iterator stacks into columns")
        return None

    @staticmethod
    def of(obj: Any, what: str = "the factory") -> "Pipeline":
        """A `Pipeline` from what a factory returned (see the module doc)."""
        if isinstance(obj, Pipeline):
            return obj
        if isinstance(obj, Batch):
            return Pipeline.from_plan(obj)
        if type(obj).__name__ == "Dataset" and type(obj).__module__.endswith("compat.grain"):
            if not obj.batched:
                raise FactoryError(f"{what} returned a zephon.compat.grain Dataset without .batch(B); "
                                   "verification compares global batches, so end the pipeline in batch().")
            loader = obj.loader()
            return Pipeline(obj.plan, obj.record_sources, tuple(obj.transforms),
                            loader_cls=type(loader), dataset=obj)
        if isinstance(obj, Mapping) and "plan" in obj and "sources" in obj:
            extra = set(obj) - {"plan", "sources", "transforms", "per_source", "seed"}
            if extra:
                raise FactoryError(f"{what} returned a dict with unknown keys {sorted(extra)}; use "
                                   "plan, sources, transforms, per_source, seed.")
            return Pipeline.of(Pipeline(**obj), what)
        if isinstance(obj, tuple) and 2 <= len(obj) <= 3 and isinstance(obj[0], Batch):
            return Pipeline(obj[0], obj[1], tuple(obj[2]) if len(obj) == 3 else ())
        raise FactoryError(f"{what} returned {type(obj).__name__}; return a zephon.testing.Pipeline"
                           "(plan, sources, transforms), a tuple (plan, sources[, transforms]) or a "
                           "zephon.compat.grain.Dataset ending in .batch(B).")

    @staticmethod
    def from_plan(plan: Batch) -> "Pipeline":
        """A pipeline that loads, for every row, its (source, record) — to verify a plan alone
        (e.g. one saved as JSON), without its data."""
        from zephon.exec.steps import leaf_sources

        sources: dict[int, IndexSource] = {0: IndexSource(2 ** 62, 0)}
        for s in leaf_sources(plan):
            sources[int(s.id)] = IndexSource(int(s.size), int(s.id))
        return Pipeline(plan, sources)


class IndexSource:
    """A record source whose record `i` is `{"source": id, "record": i}`: a plan without data."""

    def __init__(self, size: int, source_id: int = 0) -> None:
        self.size, self.source_id = int(size), int(source_id)

    def __len__(self) -> int:
        return self.size

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        idx = np.asarray(indices, np.int64)
        return {"source": np.full(len(idx), self.source_id, np.int64), "record": idx}


Factory = Callable[..., Any] | str | Pipeline


def load_plan(text_or_path: str) -> Batch:
    """A plan from its JSON (a file or the text), Grain-compatible plans included."""
    path = Path(text_or_path)
    if text_or_path.lstrip().startswith("{"):
        text = text_or_path
    elif path.is_file():
        text = path.read_text()
    else:
        raise FactoryError(f"no such file: {text_or_path}; pass a plan's JSON file (plan.canonical_json() "
                           "written to a file) or MODULE:FACTORY.")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise FactoryError(f"{text_or_path} is not JSON ({e.msg} at line {e.lineno}); pass the file "
                           "plan.canonical_json() wrote.") from None
    if isinstance(obj, dict) and "zephon_state" in obj and isinstance(obj.get("plan"), dict):
        obj = obj["plan"]  # a loader state holds its plan
    if not isinstance(obj, dict) or "type" not in obj:
        raise FactoryError(f"{text_or_path} holds JSON but not a plan (no 'type' at its top); pass "
                           "the file plan.canonical_json() (or save_state) wrote.")
    try:
        try:
            plan = Node.from_json(obj)
        except PlanError as e:
            if "unknown plan node type" not in str(e):
                raise
            import zephon.compat.grain  # noqa: F401 - registers Grain-order plan nodes

            plan = Node.from_json(obj)
    except (TypeError, KeyError, ValueError) as e:
        raise FactoryError(f"{text_or_path} is not a valid plan: {e}") from None
    if not isinstance(plan, Batch):
        raise FactoryError(f"the plan in {text_or_path} is a {type(plan).__name__}, not a complete plan; "
                           "its root must be a Batch (stream.lanes(L).batch(B)).")
    return plan


def load_factory(spec: str) -> Callable[..., Any]:
    """`"package.module:function"` or `"path/to/file.py:function"` -> the function."""
    if ":" not in spec or spec.endswith(":"):
        raise FactoryError(f"{spec!r} does not name a factory; write MODULE:FUNCTION (e.g. "
                           "my_project.data:pipeline) or path/to/file.py:FUNCTION.")
    target, _, name = spec.rpartition(":")
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise FactoryError(f"no such file: {target} (the part of {spec!r} before ':'); check "
                               "the path, relative to the current directory.")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise FactoryError(f"cannot import module {target!r} ({e}); check the name and that its "
                               "package is importable from here (pip install -e ., or PYTHONPATH), "
                               "or give a file: path/to/file.py:FUNCTION.") from None
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            funcs = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
            raise FactoryError(f"{target} has no {name!r}; its functions: {', '.join(funcs[:12]) or 'none'}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"{spec} is a {type(obj).__name__}, not a function that builds the pipeline.")
    return obj


def _import_file(path: Path) -> Any:
    """Imports `path` as the module named by its stem, with its directory on sys.path (also for
    the processes runner's and DataLoader's workers, which unpickle operators by module name)."""
    path = path.resolve()
    parent, stem = str(path.parent), path.stem
    if parent not in sys.path:
        sys.path.insert(0, parent)
        os.environ["PYTHONPATH"] = os.pathsep.join([parent] + [p for p in os.environ.get(
            "PYTHONPATH", "").split(os.pathsep) if p])
    known = sys.modules.get(stem)
    if stem.isidentifier() and (known is None or Path(getattr(known, "__file__", "") or "").resolve() == path):
        return importlib.import_module(stem)
    name = f"zephon_user_{stem}_{abs(hash(str(path))):x}"  # the stem names another module
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module


def factory_spec(factory: Factory) -> str | None:
    """A name another process can import the factory by, or None."""
    if isinstance(factory, str):
        return factory
    mod, qual = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
    if not mod or not qual or "<" in qual:
        return None
    if mod == "__main__" or mod.startswith("zephon_user_"):
        path = getattr(sys.modules.get(mod), "__file__", None)
        return f"{path}:{qual}" if path else None
    return f"{mod}:{qual}"


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class Builder:
    """Builds the pipeline of a factory for a data-parallel degree (and rank, if it asks)."""

    def __init__(self, factory: Factory) -> None:
        self.factory = factory
        self.fn: Callable[..., Any] | None = None
        if isinstance(factory, str) and factory.endswith(".json") and ":" not in factory.replace("\\", "/").split("/")[-1]:
            self.fixed = Pipeline.from_plan(load_plan(factory))
            self.spec = factory
        elif isinstance(factory, str):
            self.fn = load_factory(factory)
        elif callable(factory) and not isinstance(factory, Pipeline):
            self.fn = factory
        elif not isinstance(factory, Pipeline):
            self.fixed = Pipeline.of(factory, "the pipeline")
        if self.fn is not None:
            self.spec = factory_spec(factory)
        elif not hasattr(self, "spec"):
            self.spec = None
        self.name = (self.spec.rpartition(":")[2] if self.spec else getattr(self.fn, "__name__", "pipeline")
                     ) if self.fn is not None else (Path(self.spec).name if self.spec else "pipeline")
        self.takes_world = self.fn is not None and _accepts(self.fn, "world")
        self.takes_rank = self.fn is not None and _accepts(self.fn, "rank")
        if isinstance(factory, Pipeline):
            self.fixed = factory

    def __call__(self, world: int = 1, rank: int = 0) -> Pipeline:
        if self.fn is None:
            return self.fixed
        kw: dict[str, int] = {}
        if self.takes_world:
            kw["world"] = world
        if self.takes_rank:
            kw["rank"] = rank
        what = f"the factory {self.spec or self.name}"
        try:
            obj = self.fn(**kw)
        except (FactoryError, ZephonError):
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: name it, keep the cause
            raise FactoryError(f"{what} raised {type(e).__name__}: {e}") from e
        return Pipeline.of(obj, what)


# --- configurations -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """One stretch of a run: an emitter in one configuration, until step `until` (None: the end)."""

    backend: str = "numpy"          # numpy | jax | torch | grain
    world: int = 1                  # data-parallel degree (JAX: from the mesh and processes)
    runner: str = "inline"          # inline | threads:N | processes:N
    micro: int = 1                  # micro-batches per step, concatenated back
    mesh: tuple[int, ...] | None = None   # JAX mesh shape
    workers: int = 0                # torch DataLoader workers (ZephonDataLoader)
    procs: int = 1                  # local processes (jax.distributed / torch gloo)
    until: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise PlanError(f"unknown backend {self.backend!r}; use one of {', '.join(BACKENDS)}")
        for k in ("world", "micro", "procs"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"{k}={v!r} must be a positive integer")
        if self.workers and self.backend != "torch":
            raise PlanError("workers= is the torch DataLoader's num_workers; use it with torch")
        if self.mesh is not None and self.backend != "jax":
            raise PlanError("mesh= is for the jax backend")
        if self.procs > 1 and self.backend not in ("jax", "torch"):
            raise PlanError("procs=2 runs jax (jax.distributed) or torch (gloo) in local processes")
        if self.backend == "jax" and self.world != 1:
            raise PlanError("jax takes its data-parallel degree from the mesh and procs=; drop D=")
        if self.procs > 1 and self.world not in (1, self.procs):
            raise PlanError(f"procs={self.procs} runs one rank per process; drop D= (it is {self.procs})")

    @property
    def degree(self) -> int:
        """The data-parallel degree this segment's pipeline is built for."""
        return self.procs if self.procs > 1 else (1 if self.backend == "jax" else self.world)

    def label(self) -> str:
        out = [self.backend]
        if self.backend == "jax":
            if self.procs > 1:
                out.append(f"procs={self.procs}")
            out.append("mesh=" + "x".join(map(str, self.mesh or (8,))))
        elif self.procs > 1:
            out.append(f"procs={self.procs}")
        else:
            out.append(f"D={self.world}")
        if self.runner != "inline":
            out.append(f"runner={self.runner}")
        if self.workers:
            out.append(f"workers={self.workers}")
        if self.micro > 1:
            out.append(f"micro={self.micro}")
        if self.until is not None:
            out.append(f"@{self.until}")
        return " ".join(out)


@dataclass(frozen=True)
class Config:
    """A way to run the pipeline: one segment, or several with a stop/save/resume between them."""

    segments: tuple[Segment, ...]
    note: str = ""

    @property
    def name(self) -> str:
        return " -> ".join(s.label() for s in self.segments) + (f" ({self.note})" if self.note else "")

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def parse(text: str) -> "Config":
        """`"numpy D=2 runner=threads:2"`, `"jax mesh=2x4 micro=2"`, `"torch D=2 workers=2"`,
        `"jax procs=2 mesh=2x4"`, `"numpy D=2 @10 -> jax mesh=8"` (a stop after 10 steps)."""
        segs = []
        for part in text.split("->"):
            words = part.split()
            if not words:
                raise PlanError(f"empty segment in configuration {text!r}")
            kw: dict[str, Any] = {"backend": words[0]}
            for w in words[1:]:
                if w.startswith("@"):
                    kw["until"] = _int(w[1:], w, text)
                    continue
                key, eq, val = w.partition("=")
                if not eq:
                    raise PlanError(f"{w!r} in configuration {text!r}: write key=value (D=2, runner=threads:2, "
                                    "micro=2, mesh=2x4, workers=2, procs=2) or @STEP")
                key = {"D": "world", "d": "world", "world": "world"}.get(key, key)
                if key == "mesh":
                    kw["mesh"] = tuple(_int(x, w, text) for x in val.lower().split("x"))
                elif key == "runner":
                    kw["runner"] = val
                elif key in ("world", "micro", "workers", "procs"):
                    kw[key] = _int(val, w, text)
                else:
                    raise PlanError(f"unknown option {key!r} in configuration {text!r}; use D, runner, "
                                    "micro, mesh, workers, procs")
            segs.append(Segment(**kw))
        for s in segs[:-1]:
            if s.until is None:
                raise PlanError(f"configuration {text!r}: every segment but the last needs @STEP, "
                                "the step to stop and save at")
        if segs[-1].until is not None:
            raise PlanError(f"configuration {text!r}: the last segment runs to the end; drop its @STEP")
        stops = [s.until for s in segs[:-1]]
        if stops != sorted(set(stops)) or (stops and stops[0] < 1):  # type: ignore[type-var]
            raise PlanError(f"configuration {text!r}: stops must increase and be >= 1")
        return Config(tuple(segs))


def _int(v: str, word: str, text: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise PlanError(f"{word!r} in configuration {text!r}: {v!r} is not an integer") from None


REFERENCE = Config((Segment(),))


def default_resume(steps: int, backends: Sequence[str] = BACKENDS) -> list[Config]:
    """Stops at a third and a half of the run, across degrees and across emitters."""
    a, b = max(1, steps // 3), max(1, steps // 2)
    bk = [x for x in ("numpy", "jax", "torch", "grain") if x in backends] or ["numpy"]
    texts = [f"numpy D=2 @{a} -> numpy D=8", f"numpy D=8 @{a} -> numpy D=1 @{b} -> numpy D=4 micro=2"]
    if "jax" in bk and "torch" in bk:
        texts.append(f"jax mesh=8 @{b} -> torch D=2 micro=2")
    if "torch" in bk and "grain" in bk:
        texts.append(f"torch D=4 @{a} -> grain D=1")
    if "grain" in bk and "jax" in bk:
        texts.append(f"grain D=2 @{b} -> jax mesh=2x4 micro=2")
    if "torch" in bk:
        texts.append(f"torch D=2 workers=2 @{a} -> numpy D=4")
    return [Config.parse(t) for t in texts if steps > b]


def matrix(*, steps: int, backends: Sequence[str] = BACKENDS, degrees: Sequence[int] = (1, 2, 4, 8),
           runners: Sequence[str] = ("threads:2", "processes:2"), workers: Sequence[int] = (2,),
           micro: Sequence[int] = (2, 4), meshes: Sequence[tuple[int, ...]] = ((8,), (4, 2), (2, 4)),
           procs: int = 2, resume: Sequence[str] | None = None, repeat: bool = True) -> list[Config]:
    """The configurations to compare with the reference, one dimension at a time.

    Every backend at every degree (JAX: every mesh, one process), the runners at D=2, the torch
    DataLoader with workers, micro-batch counts on every backend, `procs` local processes for JAX
    and torch, stop/resume configurations (`resume`: `"STEP:D1->D2"`, emitters rotating through
    `backends`, or None for `default_resume`), and the reference run once more (`repeat`).
    """
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise PlanError(f"unknown backends {unknown}; choose among {', '.join(BACKENDS)}")
    out: list[Config] = []
    d2 = next((d for d in degrees if d > 1), 1)
    if repeat:
        out.append(replace(REFERENCE, note="second run"))
    for b in backends:
        if b == "jax":
            out += [Config((Segment("jax", mesh=tuple(m)),)) for m in meshes]
            continue
        out += [Config((Segment(b, world=d),)) for d in degrees if not (b == "numpy" and d == 1)]
    if "numpy" in backends:
        out += [Config((Segment("numpy", world=d2, runner=r),)) for r in runners]
    if "torch" in backends:
        out += [Config((Segment("torch", world=1, workers=w),)) for w in workers if w]
    for i, m in enumerate(x for x in micro if x > 1):
        for b in backends:
            seg = (Segment("jax", mesh=tuple(meshes[i % len(meshes)]) if meshes else (8,), micro=m)
                   if b == "jax" else Segment(b, world=degrees[(i + 1) % len(degrees)] if degrees else 1, micro=m))
            out.append(Config((seg,)))
    if procs > 1:
        if "jax" in backends:
            out.append(Config((Segment("jax", procs=procs, mesh=(procs, 8 // procs) if 8 % procs == 0 else (procs,)),)))
        if "torch" in backends:
            out.append(Config((Segment("torch", procs=procs),)))
    if resume is None:
        out += default_resume(steps, backends)
    else:
        for i, spec in enumerate(resume):
            m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*->\s*(\d+)\s*", spec)
            if not m:
                raise PlanError(f"resume {spec!r}: write STEP:D1->D2, e.g. 10:2->8 (stop after step 10 "
                                "at D=2, resume at D=8)")
            at, d1, d2_ = (int(x) for x in m.groups())
            if not 0 < at < steps:
                raise PlanError(f"resume {spec!r}: the stop {at} must be inside the run (1..{steps - 1})")
            b1, b2 = backends[i % len(backends)], backends[(i + 1) % len(backends)]
            s1 = Segment(b1, world=1 if b1 == "jax" else d1, until=at, mesh=(8,) if b1 == "jax" else None)
            s2 = Segment(b2, world=1 if b2 == "jax" else d2_, mesh=(8,) if b2 == "jax" else None)
            out.append(Config((s1, s2)))
    return out


# --- running a configuration --------------------------------------------------------------------

@dataclass
class StepOut:
    """One step of a segment: per rank, the lanes it holds and their rows (numpy)."""

    parts: list[tuple[np.ndarray, dict[str, np.ndarray]]]
    batches: list[LocalBatch] | None = None     # provenance, when the emitter has it


def _json_round_trip(state: Any) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def _doc(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state document inside a Grain iterator's state (older iterators wrapped it)."""
    if "loader" in state and "zephon_state" not in state:
        return dict(state["loader"])
    return {k: v for k, v in state.items() if k != "elements_taken"}


def _np_micro(cols: Mapping[str, Any], n: int) -> dict[str, np.ndarray]:
    if n == 1:
        return dict(cols)
    from zephon.backends.numpy import micro_batches

    parts = micro_batches(dict(cols), n)
    return {k: np.concatenate([p[k] for p in parts]) for k in cols}


def _runner(spec: str) -> Any:
    from zephon.runners import from_spec

    return None if spec == "inline" else from_spec(spec)


def _check_degree(pipe: Pipeline, world: int) -> str | None:
    lanes = pipe.plan.lanes.count
    if lanes % world:
        return f"lanes={lanes} is not divisible by D={world}"
    return None


class _Session:
    """An emitter over every rank of one segment, in this process."""

    has_provenance = False

    def restore(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def step(self) -> StepOut:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _NumpySession(_Session):
    has_provenance = True

    def __init__(self, pipes: list[Pipeline], seg: Segment) -> None:
        self.seg = seg
        self.loaders = [p.loader(rank=r, world=seg.world, runner=_runner(seg.runner))
                        for r, p in enumerate(pipes)]

    def restore(self, state: dict[str, Any]) -> None:
        for l in self.loaders:
            l.restore(state)

    def step(self) -> StepOut:
        batches = [next(l) for l in self.loaders]
        return StepOut([(b.lanes, _np_micro(b.data, self.seg.micro)) for b in batches],
                       [replace(b, data={}) for b in batches])

    def state(self) -> dict[str, Any]:
        return _json_round_trip(merge_states([l.state() for l in self.loaders]))

    def close(self) -> None:
        for l in self.loaders:
            l.close()


class _GrainSession(_Session):
    """The Grain-compatible iterator (`get_state`/`set_state`) over every rank."""

    def __init__(self, pipes: list[Pipeline], seg: Segment) -> None:
        import zephon.compat.grain as zg

        self.zg, self.seg = zg, seg
        self.iters = [zg.Iterator(p.loader(rank=r, world=seg.world, runner=_runner(seg.runner)), batched=True)
                      for r, p in enumerate(pipes)]

    def restore(self, state: dict[str, Any]) -> None:
        for it in self.iters:
            it.set_state(copy.deepcopy(state))

    def step(self) -> StepOut:
        parts = []
        for it in self.iters:
            batch = next(it)
            if self.seg.micro > 1:
                from zephon.backends.numpy import micro_batches

                micro = micro_batches(batch if isinstance(batch, Mapping) else {"": batch}, self.seg.micro)
                cols = [self.zg.grain_batch_columns(m) for m in micro]
                flat = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}
            else:
                flat = self.zg.grain_batch_columns(batch)
            parts.append((it.loader.owned, flat))
        return StepOut(parts)

    def state(self) -> dict[str, Any]:
        return _json_round_trip(merge_states([_doc(it.get_state()) for it in self.iters]))

    def close(self) -> None:
        for it in self.iters:
            it.close()


def _torch_to_numpy(v: Any) -> np.ndarray:
    import torch

    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def _torch_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """What `torch.save` + `torch.load(weights_only=True)` give back."""
    import torch

    buf = io.BytesIO()
    torch.save({"data": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["data"]


class _TorchSession(_Session):
    """`TorchLoader` per rank, or `ZephonDataLoader` with `workers` DataLoader workers."""

    def __init__(self, pipes: list[Pipeline], seg: Segment) -> None:
        from zephon.backends.torch import TorchLoader, ZephonDataLoader, ZephonIterableDataset

        self.seg = seg
        self.loaders: list[Any] = []
        self.iters: list[Any] = []
        for r, p in enumerate(pipes):
            if seg.workers:
                ds = ZephonIterableDataset(p.plan, p.sources, tuple(p.transforms), rank=r, world=seg.world,
                                           runner=_runner(seg.runner), **p.backend_kwargs())
                # fork after JAX started its threads can deadlock: then start workers clean
                ctx = "forkserver" if "jax" in sys.modules else None
                self.loaders.append(ZephonDataLoader(ds, num_workers=seg.workers,
                                                     multiprocessing_context=ctx))
            else:
                self.loaders.append(TorchLoader(p.plan, p.sources, tuple(p.transforms), rank=r,
                                                world=seg.world, runner=_runner(seg.runner),
                                                **p.backend_kwargs()))
        self.owned = [p.plan.lanes.owned(r, seg.world) for r, p in enumerate(pipes)]

    def _iter(self, r: int) -> Any:
        while len(self.iters) <= r:
            self.iters.append(None)
        if self.iters[r] is None:
            self.iters[r] = iter(self.loaders[r])
        return self.iters[r]

    def restore(self, state: dict[str, Any]) -> None:
        for l in self.loaders:
            l.load_state_dict(_torch_round_trip(state))
        self._drop_iters()

    def step(self) -> StepOut:
        parts = []
        for r in range(len(self.loaders)):
            batch = next(self._iter(r))
            if self.seg.micro > 1:
                import torch

                micro = batch.micro_batches(self.seg.micro)
                batch = {k: torch.cat([m[k] for m in micro]) if isinstance(batch[k], torch.Tensor)
                         else np.concatenate([m[k] for m in micro]) for k in batch}
            parts.append((self.owned[r], {k: _torch_to_numpy(v) for k, v in batch.items()}))
        return StepOut(parts)

    def state(self) -> dict[str, Any]:
        return merge_states([_torch_round_trip(l.state_dict()) for l in self.loaders])

    def _drop_iters(self) -> None:
        for it in self.iters:
            stop = getattr(it, "_shutdown_workers", None)
            if stop is not None:
                stop()
        self.iters = []

    def close(self) -> None:
        self._drop_iters()
        for l in self.loaders:
            getattr(l, "close", lambda: None)()


def _jax_local_rows(arr: Any) -> tuple[int, np.ndarray]:
    """(first global row, rows) of the contiguous block this process's devices hold."""
    blocks: dict[int, np.ndarray] = {}
    for shard in arr.addressable_shards:
        start, _, _ = shard.index[0].indices(arr.shape[0]) if shard.index else (0, 0, 1)
        if start not in blocks:
            blocks[start] = np.asarray(shard.data)
    starts = sorted(blocks)
    return starts[0], np.concatenate([blocks[s] for s in starts])


def _jax_canonical(ref: np.dtype) -> np.dtype:
    import jax

    try:
        return np.dtype(jax.dtypes.canonicalize_dtype(ref))
    except TypeError:
        return ref


class _JaxSession(_Session):
    """`JaxLoader` over a mesh of this process's devices (or of every process's, under
    jax.distributed); fields JAX cannot hold (bytes, text) are left out and not compared."""

    def __init__(self, pipe: Pipeline, seg: Segment, ref_dtypes: Mapping[str, np.dtype]) -> None:
        import jax
        from jax.sharding import Mesh

        from zephon.backends.jax import JaxLoader, _jax_dtype

        shape = tuple(seg.mesh or (8,))
        need = math.prod(shape)
        if jax.device_count() < need:
            raise _NotApplicable(f"mesh {'x'.join(map(str, shape))} needs {need} devices, JAX has "
                                 f"{jax.device_count()} (set XLA_FLAGS={_FAKE_DEVICES}=8 before jax "
                                 "is imported, e.g. in conftest.py)")
        names = ("data", "fsdp", "model", "x4")[:len(shape)]
        mesh = Mesh(np.array(jax.devices()[:need]).reshape(shape), names)
        self.seg, self.ref_dtypes = seg, dict(ref_dtypes)
        self.excluded = sorted(k for k, d in ref_dtypes.items()
                               if d.kind in "OUS" or (d.kind == "V" and not _jax_dtype(d)))
        self.plan = pipe.plan
        self.loader = JaxLoader(pipe.plan, pipe.sources, tuple(pipe.transforms), mesh=mesh,
                                batch_axes=names, exclude=self.excluded, runner=_runner(seg.runner),
                                **pipe.backend_kwargs())
        self.owned = pipe.plan.lanes.owned(self.loader.layout.rank, self.loader.layout.world)

    def restore(self, state: dict[str, Any]) -> None:
        self.loader.restore(state)

    def step(self) -> StepOut:
        arrays = next(self.loader)
        if self.seg.micro > 1:
            from zephon.backends.jax import join_micro_batches

            arrays = join_micro_batches(arrays.micro_batches(self.seg.micro))
        cols = {}
        for k, v in arrays.items():
            _, rows = _jax_local_rows(v)
            want = self.ref_dtypes.get(k)
            if want is not None and rows.dtype != want and _jax_canonical(want) == rows.dtype:
                rows = rows.astype(want)  # JAX's 32-bit canonical dtype; values were range-checked
            cols[k] = rows
        return StepOut([(self.owned, cols)])

    def state(self) -> dict[str, Any]:
        return _json_round_trip(self.loader.state())

    def close(self) -> None:
        self.loader.close()


class _NotApplicable(Exception):
    """This configuration cannot run this pipeline (reported as n/a, with the reason)."""


def _session(builder: Builder, seg: Segment, ref_dtypes: Mapping[str, np.dtype]) -> _Session:
    """The emitter of `seg` over all its ranks. A PlanError while building it (the pipeline built
    fine for the reference) means this emitter cannot take the pipeline: n/a, with the reason."""
    pipes = [builder(seg.degree, r) for r in range(seg.degree if builder.takes_rank else 1)]
    try:
        return _make_session(builder, pipes, seg, ref_dtypes)
    except PlanError as e:
        raise _NotApplicable(str(e)) from e


def _make_session(builder: Builder, pipes: list[Pipeline], seg: Segment,
                  ref_dtypes: Mapping[str, np.dtype]) -> _Session:
    why = _check_degree(pipes[0], seg.degree)
    if why:
        raise _NotApplicable(why)
    if not builder.takes_rank:
        pipes = pipes * seg.degree
    if seg.micro > 1:
        plan = pipes[0].plan
        shards = math.prod(seg.mesh or (8,)) if seg.backend == "jax" else seg.degree
        held = plan.size // shards
        if plan.size % shards == 0 and held % seg.micro:
            raise _NotApplicable(f"micro={seg.micro} does not divide the {held} row(s) each "
                                 f"{'device' if seg.backend == 'jax' else 'rank'} holds")
    if seg.backend in ("jax", "torch"):
        why = pipes[0].backend_refusal()
        if why:
            raise _NotApplicable(why)
    if seg.backend == "numpy":
        return _NumpySession(pipes, seg)
    if seg.backend == "grain":
        return _GrainSession(pipes, seg)
    if seg.backend == "torch":
        return _TorchSession(pipes, seg)
    return _JaxSession(pipes[0], seg, ref_dtypes)


@dataclass
class Run:
    """What a configuration produced: per step, lane records; provenance where available."""

    records: list[StepRecord] = field(default_factory=list)
    batches: list[list[LocalBatch] | None] = field(default_factory=list)
    excluded: frozenset[str] = frozenset()
    plan_fingerprint: str = ""
    plan_json: Any = None
    dtypes: dict[str, np.dtype] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _subprocess_env(devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + env.get("PYTHONPATH", "").split(os.pathsep)))
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_FAKE_DEVICES)]
    if devices:
        flags.append(f"{_FAKE_DEVICES}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _run_processes(builder: Builder, seg: Segment, start: int, stop: int, state: dict[str, Any] | None,
                   ref_dtypes: Mapping[str, np.dtype], timeout: float) -> tuple[list[StepRecord], dict[str, Any], list[str]]:
    """Runs steps [start, stop) of a segment in `seg.procs` local processes; returns the merged
    lane records, the merged state after `stop` and the fields left out."""
    if builder.spec is None:
        raise _NotApplicable("runs in several processes need a factory importable by name "
                             "(module:function or path/file.py:function), not a local function")
    with tempfile.TemporaryDirectory(prefix="zephon-procs-") as tmp:
        restore = None
        if state is not None:
            restore = os.path.join(tmp, "restore.json")
            Path(restore).write_text(json.dumps(state))
        port, procs, outs, logs = _free_port(), [], [], []
        args = {"factory": builder.spec, "segment": replace(seg, until=None).label(), "port": port, "start": start,
                "stop": stop, "restore": restore,
                "ref_dtypes": {k: np.dtype(v).str for k, v in ref_dtypes.items()}}
        devices = 8 // seg.procs if seg.backend == "jax" else None
        try:
            for i in range(seg.procs):
                outs.append(os.path.join(tmp, f"out{i}.json"))
                logs.append(os.path.join(tmp, f"log{i}.txt"))
                with open(logs[i], "wb") as log:  # a file, not a pipe: a chatty process cannot block
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "zephon.testing", "worker",
                         json.dumps({**args, "process": i, "out": outs[i]})],
                        env=_subprocess_env(devices), stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            for i, p in enumerate(procs):
                try:
                    code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"process {i} of {seg.procs} did not finish in {timeout:.0f} s; "
                                       f"its log ends: {Path(logs[i]).read_text(errors='replace')[-800:]}") from None
                if code != 0:
                    tail = Path(logs[i]).read_text(errors="replace").strip().splitlines()
                    raise RuntimeError(f"process {i} of {seg.procs} exited with {code}: "
                                       + " | ".join(tail[-6:]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = [json.loads(Path(o).read_text()) for o in outs]
    for r in results:
        if "not_applicable" in r:
            raise _NotApplicable(r["not_applicable"])
    records: list[StepRecord] = []
    for k in range(stop - start):
        merged: StepRecord = {}
        for r in results:
            merged.update({int(l): LaneRecord.from_json(v) for l, v in r["records"][k].items()})
        records.append(merged)
    return records, merge_states([r["state"] for r in results]), results[0]["excluded"]


def run_config(builder: Builder, config: Config, steps: int, *, ref_dtypes: Mapping[str, np.dtype] = {},
               keep_batches: bool = False, timeout: float = 600.0, on_step: Callable[[], None] | None = None) -> Run:
    """Runs `config` for `steps` global steps. Raises `_NotApplicable` when it cannot run."""
    run = Run()
    state: dict[str, Any] | None = None
    first = builder(config.segments[0].degree, 0)
    run.plan_fingerprint, run.plan_json = first.plan.fingerprint(), first.plan.to_json()
    for i, seg in enumerate(config.segments):
        stop = steps if seg.until is None else min(seg.until, steps)
        last = i == len(config.segments) - 1
        if seg.procs > 1:
            recs, state, excluded = _run_processes(builder, seg, len(run.records), stop, state,
                                                   ref_dtypes, timeout)
            run.records += recs
            run.batches += [None] * len(recs)
            run.excluded |= frozenset(excluded)
            continue
        sess = _session(builder, seg, ref_dtypes)
        try:
            run.excluded |= frozenset(getattr(sess, "excluded", ()))
            if state is not None:
                sess.restore(state)
            while len(run.records) < stop:
                try:
                    out = sess.step()
                except StopIteration:
                    break
                merged: StepRecord = {}
                for lanes, cols in out.parts:
                    merged.update(lane_records(lanes, cols))
                    if not run.dtypes:
                        run.dtypes = {k: np.asarray(v).dtype for k, v in cols.items()}
                run.records.append(merged)
                run.batches.append(out.batches if keep_batches else None)
                if on_step is not None:
                    on_step()
            if not last:
                state = sess.state()
        finally:
            sess.close()
    return run


# --- comparing with the reference -------------------------------------------------------------

def _explain_row(batches: list[LocalBatch] | None, lane: int, j: int) -> str | None:
    if not batches:
        return None
    for b in batches:
        hit = np.flatnonzero(np.asarray(b.lanes) == lane)
        if len(hit) and (b.refs is not None or b.segments is not None):
            try:
                return describe_row(b.explain()[int(hit[0]) * b.rows_per_lane + j])
            except (IndexError, TypeError):
                return None
    return None


def divergence(ref: Run, run: Run) -> tuple[Divergence | None, list[bool]]:
    """The first difference of `run` from `ref` (None if identical) and per-step equality."""
    ignore = run.excluded
    matches = [compare_steps(a, b, ignore) is None for a, b in zip(ref.records, run.records)]
    found: Divergence | None = None
    for s, (a, b) in enumerate(zip(ref.records, run.records)):
        hit = compare_steps(a, b, ignore)
        if hit is None:
            continue
        lane, j, name, detail = hit
        per = a[lane].rows if lane is not None and lane in a else 0
        row = None if lane is None or j is None else lane * per + j
        if run.plan_fingerprint and run.plan_fingerprint != ref.plan_fingerprint:
            from zephon.plan import plan_diff

            diffs = plan_diff(ref.plan_json, run.plan_json)
            detail += f"; the factory built another plan for this configuration ({'; '.join(diffs[:3])})"
        found = Divergence(s, lane, row, name, detail,
                           expected=_explain_row(ref.batches[s] if s < len(ref.batches) else None,
                                                 lane, j) if lane is not None and j is not None else None,
                           got=_explain_row(run.batches[s] if s < len(run.batches) else None, lane, j)
                           if lane is not None and j is not None else None)
        break
    if found is None and len(run.records) != len(ref.records):
        n = min(len(run.records), len(ref.records))
        found = Divergence(n, detail=f"this run ended after {len(run.records)} steps, the reference "
                                     f"after {len(ref.records)}")
    return found, matches


def _reference(builder: Builder, steps: int) -> tuple[Run, dict[str, np.dtype]]:
    ref = run_config(builder, REFERENCE, steps, keep_batches=True)
    if not ref.records:
        raise PlanError("the pipeline produced no global batch; check its plan and sources")
    return ref, ref.dtypes


def verify(factory: Factory, configs: Iterable[Config | str], steps: int = 20, *,
           progress: bool = False, name: str | None = None, timeout: float = 600.0) -> Report:
    """Runs the reference (numpy, D=1) and every configuration for `steps` steps and reports how
    each compares. Never raises for a difference (see `Report.ok`); raises `FactoryError` /
    `PlanError` when the pipeline itself cannot be built or run."""
    builder = factory if isinstance(factory, Builder) else Builder(factory)
    configs = [Config.parse(c) if isinstance(c, str) else c for c in configs]
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=(len(configs) + 1) * steps, desc=name or builder.name, unit="step",
                   leave=False, dynamic_ncols=True)
    tick = (lambda: bar.update(1)) if bar is not None else None
    try:
        t = time.perf_counter()
        ref, dtypes = _reference(builder, steps)
        if bar is not None:
            bar.update(steps)
        ref_fps = [record_fingerprint(r) for r in ref.records]
        results = [RunResult(REFERENCE.name + " (reference)", "identical", len(ref.records), ref_fps,
                             [True] * len(ref.records), seconds=time.perf_counter() - t)]
        for cfg in configs:
            if bar is not None:
                bar.set_postfix_str(cfg.name[:40])
            t = time.perf_counter()
            done = 0

            def count() -> None:
                nonlocal done
                done += 1
                if tick is not None:
                    tick()

            try:
                run = run_config(builder, cfg, len(ref.records), ref_dtypes=dtypes, keep_batches=True,
                                 timeout=timeout, on_step=count)
            except _NotApplicable as e:
                results.append(RunResult(cfg.name, "n/a", note=str(e), seconds=time.perf_counter() - t))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - a failing configuration is a result
                results.append(RunResult(cfg.name, "error", note=f"{type(e).__name__}: {e}",
                                         seconds=time.perf_counter() - t,
                                         detail="".join(traceback.format_exception(e)[-4:])))
            else:
                div, matches = divergence(ref, run)
                fps = [record_fingerprint(r) for r in run.records]
                note = ""
                if run.excluded:
                    note = f"not compared: {', '.join(sorted(run.excluded))} (JAX cannot hold them)"
                results.append(RunResult(cfg.name, "identical" if div is None else "differs",
                                         len(run.records), fps, matches, div, note,
                                         time.perf_counter() - t))
            finally:
                if bar is not None:
                    bar.update(max(0, len(ref.records) - done))
    finally:
        if bar is not None:
            bar.close()
    return Report(name or builder.name, len(ref.records), results, ref.plan_fingerprint,
                  time.perf_counter() - t0)


# --- one-call assertions -------------------------------------------------------------------------

def _raise(report: Report, what: str) -> Report:
    if report.ok:
        return report
    bad = [r for r in report.results if not r.ok]
    lines = [f"{what}: {report.summary()}"]
    for r in bad[:4]:
        lines.append(f"  {r.name}: {r.verdict()}")
        if r.divergence is not None:
            lines += ["    " + l for l in str(r.divergence).splitlines()]
        elif r.note:
            lines += ["    " + l for l in r.note.splitlines()[:6]]
    if len(bad) > 4:
        lines.append(f"  ... and {len(bad) - 4} more")
    raise DeterminismError("\n".join(lines))


def _degrees(builder: Builder, degrees: Sequence[int]) -> list[int]:
    lanes = builder(1, 0).plan.lanes.count
    return [d for d in degrees if lanes % d == 0]


def assert_elastic(factory: Factory, degrees: Sequence[int] = (1, 2, 4, 8), steps: int = 20,
                   mapping_note: str = "") -> Report:
    """The same global batches at every data-parallel degree in `degrees` that divides the lane
    count (degrees that do not are skipped)."""
    b = Builder(factory)
    return _raise(verify(b, [Config((Segment(world=d),)) for d in _degrees(b, degrees) if d > 1] or
                         [replace(REFERENCE, note="second run")], steps), "not elastic")


def assert_runners_agree(factory: Factory, runners: Sequence[str] = ("threads:2", "processes:2"),
                         world: int = 2, steps: int = 20) -> Report:
    """Runners and worker counts change nothing (processes need picklable, module-level operators)."""
    return _raise(verify(factory, [Config((Segment(world=world, runner=r),)) for r in runners], steps),
                  "runners disagree")


def assert_emitters_agree(factory: Factory, backends: Sequence[str] = ("jax", "torch", "grain"),
                          steps: int = 20, world: int = 2, meshes: Sequence[tuple[int, ...]] = ((8,), (2, 4)),
                          torch_workers: int = 0) -> Report:
    """numpy, JAX (every mesh in `meshes`), torch (also with DataLoader workers) and the Grain API
    iterator emit the same global batches."""
    configs: list[Config] = []
    for b in backends:
        if b == "jax":
            configs += [Config((Segment("jax", mesh=tuple(m)),)) for m in meshes]
        elif b == "numpy":
            configs.append(Config((Segment("numpy", world=world),)))
        else:
            configs.append(Config((Segment(b, world=world),)))
    if torch_workers and "torch" in backends:
        configs.append(Config((Segment("torch", workers=torch_workers),)))
    return _raise(verify(factory, configs, steps), "emitters disagree")


def assert_resumes(factory: Factory, stops: Sequence[int] | None = None,
                   degrees: Sequence[tuple[int, int]] = ((2, 8), (8, 1), (1, 4)),
                   backends: Sequence[str] = ("numpy",), steps: int = 20) -> Report:
    """Stopping after each step in `stops`, saving the state (JSON round trip), merging the ranks'
    states and resuming at another degree continues with the same batches. With several
    `backends` each resume also crosses emitters (the state of one restores in the next)."""
    b = Builder(factory)
    stops = list(stops) if stops is not None else [max(1, steps // 3), max(1, 2 * steps // 3)]
    ok = set(_degrees(b, sorted({d for pair in degrees for d in pair})))
    configs = []
    i = 0
    for at in stops:
        for d1, d2 in degrees:
            if d1 in ok and d2 in ok:
                b1, b2 = backends[i % len(backends)], backends[(i + 1) % len(backends)]
                s1 = Segment(b1, world=1 if b1 == "jax" else d1, until=at)
                s2 = Segment(b2, world=1 if b2 == "jax" else d2)
                configs.append(Config((s1, s2)))
                i += 1
    return _raise(verify(b, configs, steps), "resume changes the batches")


def assert_micro_batches(factory: Factory, counts: Sequence[int] = (2, 4),
                         backends: Sequence[str] = ("numpy", "jax", "torch"), world: int = 2,
                         steps: int = 10) -> Report:
    """`batch.micro_batches(n)` concatenates to the batch on every emitter, for every count, and a
    resume that changes the count changes nothing."""
    configs = []
    for n in counts:
        for bk in backends:
            configs.append(Config((Segment(bk, world=1 if bk == "jax" else world, micro=n),)))
    if len(counts) > 0 and steps > 2:
        a, b = counts[0], counts[-1]
        configs.append(Config((Segment("numpy", world=world, micro=a, until=steps // 2),
                               Segment(backends[-1], world=1 if backends[-1] == "jax" else world, micro=b))))
    return _raise(verify(factory, configs, steps), "micro-batches change the data")


def assert_deterministic(factory: Factory, steps: int = 20, **options: Any) -> Report:
    """The whole default matrix (`matrix(...)` options): degrees, runners, emitters, micro-batches,
    two local processes, stop/resume across degrees and emitters, and a repeated reference run."""
    return _raise(verify(factory, matrix(steps=steps, **options), steps), "not deterministic")


# --- the process side of multi-process runs --------------------------------------------------------

def _worker(args: dict[str, Any]) -> None:
    """One of `procs` local processes running a segment (`python -m zephon.testing worker ARGS`)."""
    seg = Config.parse(args["segment"]).segments[0]
    builder = Builder(args["factory"])
    i, procs = int(args["process"]), seg.procs
    ref_dtypes = {k: np.dtype(v) for k, v in args["ref_dtypes"].items()}
    restore = json.loads(Path(args["restore"]).read_text()) if args["restore"] else None
    records: list[dict[str, Any]] = []
    excluded: list[str] = []
    if seg.backend == "jax":
        import jax

        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args['port']}",
                                   num_processes=procs, process_id=i)
        try:
            pipe = builder(procs, i)
            try:
                sess = _JaxSession(pipe, replace(seg, procs=1), ref_dtypes)
            except (PlanError, _NotApplicable) as e:
                Path(args["out"]).write_text(json.dumps({"not_applicable": str(e)}))
                return
            excluded = sess.excluded
            if restore is not None:
                sess.restore(restore)
            for _ in range(args["stop"] - args["start"]):
                out = sess.step()
                lanes, cols = out.parts[0]
                records.append({str(l): r.to_json() for l, r in lane_records(lanes, cols).items()})
            state = sess.state()
            sess.close()
        finally:
            jax.distributed.shutdown()
    else:
        import datetime

        import torch.distributed as dist

        from zephon.backends.torch import TorchLoader

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=i,
                                world_size=procs, timeout=datetime.timedelta(seconds=120))
        try:
            pipe = builder(procs, i)
            try:
                why = _check_degree(pipe, procs) or pipe.backend_refusal()
                if why:
                    raise _NotApplicable(why)
                loader = TorchLoader(pipe.plan, pipe.sources, tuple(pipe.transforms),
                                     runner=_runner(seg.runner), **pipe.backend_kwargs())  # rank/world: gloo's
            except (PlanError, _NotApplicable) as e:
                Path(args["out"]).write_text(json.dumps({"not_applicable": str(e)}))
                return
            if restore is not None:
                loader.load_state_dict(_torch_round_trip(restore))
            owned = pipe.plan.lanes.owned(loader.rank, loader.world)
            for _ in range(args["stop"] - args["start"]):
                batch = next(loader)
                if seg.micro > 1:
                    import torch

                    micro = batch.micro_batches(seg.micro)
                    batch = {k: torch.cat([m[k] for m in micro]) if isinstance(batch[k], torch.Tensor)
                             else np.concatenate([m[k] for m in micro]) for k in batch}
                cols = {k: _torch_to_numpy(v) for k, v in batch.items()}
                records.append({str(l): r.to_json() for l, r in lane_records(owned, cols).items()})
            state = _torch_round_trip(loader.state_dict())
            loader.close()
        finally:
            dist.destroy_process_group()
    Path(args["out"]).write_text(json.dumps({"records": records, "state": state, "excluded": excluded}))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "worker":
        _worker(json.loads(argv[1]))
        return 0
    print("zephon.testing is a library (see its module doc) and the process side of "
          "`zephon verify`'s multi-process runs; run `zephon verify --help`.", file=sys.stderr)
    return 2


__all__ = [
    "BACKENDS", "Builder", "Config", "DeterminismError", "FactoryError", "IndexSource", "Pipeline",
    "REFERENCE", "Segment", "assert_deterministic", "assert_elastic", "assert_emitters_agree",
    "assert_micro_batches", "assert_resumes", "assert_runners_agree", "default_resume",
    "load_factory", "matrix", "run_config", "verify",
]


if __name__ == "__main__":
    from zephon.testing import main as _main  # the module's classes, not a second __main__ copy

    sys.exit(_main())

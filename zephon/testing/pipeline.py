"""The pipeline under test: what a factory returns (`Pipeline`), how a factory is found
(`load_factory`, `load_plan` for a saved plan) and built for a degree and rank (`Builder`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zephon.errors import PlanError, ZephonError
from zephon.exec.loader import Loader
from zephon.plan import Batching, Node
from zephon.runners.base import Runner
from zephon.storage.url import is_remote


class FactoryError(ZephonError, ValueError):
    """The pipeline factory cannot be found, imported or called, or returned something else."""


# --- the pipeline under test ----------------------------------------------------------------------

@dataclass(frozen=True)
class Pipeline:
    """What a factory returns: the arguments of `zephon.Loader`.

    `loader_cls` is the loader class (a `zephon.compat.grain` pipeline uses its own); `dataset`
    keeps the Grain-shaped `Dataset` a pipeline came from.
    """

    plan: Batching
    sources: Any
    transforms: Sequence[Any] = ()
    per_source: Mapping[int, Sequence[Any]] | None = None
    seed: int = 0
    loader_cls: type = Loader
    dataset: Any = None

    def loader(self, *, rank: int = 0, world: int = 1, runner: Runner | None = None, **options: Any) -> Loader:
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
    def of(obj: Any, what: str = "the factory") -> Pipeline:
        """A `Pipeline` from what a factory returned (see the module doc)."""
        if isinstance(obj, Pipeline):
            return obj
        if isinstance(obj, Batching):
            return Pipeline.from_plan(obj)
        zg = sys.modules.get("zephon.compat.grain")  # loaded if obj can be one of its Datasets
        if zg is not None and isinstance(obj, zg.Dataset):
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
        if isinstance(obj, tuple) and 2 <= len(obj) <= 3 and isinstance(obj[0], Batching):
            return Pipeline(obj[0], obj[1], tuple(obj[2]) if len(obj) == 3 else ())
        raise FactoryError(f"{what} returned {type(obj).__name__}; return a zephon.testing.Pipeline"
                           "(plan, sources, transforms), a tuple (plan, sources[, transforms]) or a "
                           "zephon.compat.grain.Dataset ending in .batch(B).")

    @staticmethod
    def from_plan(plan: Batching) -> Pipeline:
        """A pipeline that loads, for every row, its (source, record) — to verify a plan alone
        (e.g. one saved as JSON), without its data."""
        from zephon.plan.walk import leaf_sources

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


def load_plan(text_or_path: str) -> Batching:
    """A plan from its JSON (a file or the text), Grain-compatible plans included."""
    path = Path(text_or_path)
    if text_or_path.lstrip().startswith("{"):
        text = text_or_path
    elif is_remote(text_or_path):  # s3:// or gs://: read through zephon.storage
        from zephon.storage import ObjectMissingError, read_object

        try:
            text = read_object(text_or_path).decode("utf-8", errors="replace")
        except ObjectMissingError as e:
            raise FactoryError(f"{e} Pass a plan's JSON object (plan.canonical_json() written "
                               "to it) or MODULE:FACTORY.") from None
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
    if not isinstance(plan, Batching):
        raise FactoryError(f"the plan in {text_or_path} is a {type(plan).__name__}, not a complete plan; "
                           "its root must be a Batching (stream.lanes(L).batch(B)).")
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
        self.spec: str | None = None
        if (isinstance(factory, str) and factory.endswith(".json")
                and ":" not in factory.replace("\\", "/").split("/")[-1]):  # a saved plan, not a.py:fn
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
        except Exception as e:
            raise FactoryError(f"{what} raised {type(e).__name__}: {e}") from e
        return Pipeline.of(obj, what)

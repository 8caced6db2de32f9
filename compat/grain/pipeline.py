"""`TailMixin`: how a `Dataset` splits into the plan's head and Grain's tail (see `tail`).

Kept apart from `dataset` (the Grain-shaped methods): this is the glue that lets a pipeline run
past the plan's global batch — a smaller last batch, `batch_fn`, steps after `batch`, Grain's
iterator datasets — and index past its end (Grain's next epoch), and `mp_prefetch` (Grain's
worker counts as a Zephon runner: `options_runner`).
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import grain

from zephon.errors import PlanError
from zephon.pipeline import How, Where
from zephon.runners import processes, threads
from zephon.runners.base import Runner

from .compile import Compiled, GraphOp, row_ops
from .tail import Split, Tail, split
from .transforms import has_accumulator
from .warn import warn_once

if TYPE_CHECKING:
    from .dataset import Dataset

_WHERE_FIELDS = frozenset(f.name for f in dataclasses.fields(Where))
_HOW_FIELDS = frozenset(f.name for f in dataclasses.fields(How))


class TailMixin:
    """The head/tail split of a `Dataset` (the methods below read `_op` and `_config`)."""

    _op: GraphOp
    _config: Any
    if TYPE_CHECKING:  # provided by Dataset
        @property
        def packed(self) -> bool: ...
        @property
        def _token_mixed(self) -> bool: ...
        @property
        def batched(self) -> bool: ...
        @property
        def _compiled(self) -> Compiled: ...
        def _in_iter(self) -> bool: ...
        def _item(self, index: int) -> Any: ...
        def runner(self, runner: Any) -> Dataset: ...

    def _derive(self, op: GraphOp, config: Any) -> Dataset:
        """A dataset of this one's class over `op` (this module does not import `dataset`)."""
        return cast("Dataset", type(self)(op, config))  # type: ignore[call-arg]

    @functools.cached_property
    def _split(self) -> Split:
        """The head the plan runs and the tail after it (`tail.split`)."""
        return split(self._op, lambda op: self._derive(op, self._config)._compiled.stream.length,
                     self.packed or self._token_mixed)

    @functools.cached_property
    def _tail(self) -> Tail | None:
        sp = self._split
        if not sp.tail:
            return None
        # the tail reads the head's elements in Grain's order: one lane (lanes only change
        # speed and state layout, and an unbatched multi-lane stream ends at a whole step)
        head = None if sp.head is None else self._derive(sp.head, replace(self._config, lanes=None,
                                                                      rank=None, world=None))
        def head_len() -> int:
            assert head is not None  # a tail starting with a leaf is not random access
            return len(head)

        def head_item(i: int) -> Any:
            assert head is not None
            return head._item(i)

        return Tail(sp.tail, head_len=head_len, head_item=head_item,
                    head_iter=lambda: None if head is None else iter(head),
                    head_is_map=head is not None and not head._in_iter(),
                    leaf=lambda o: o.args["make"]())

    @property
    def _remainder_only(self) -> bool:
        """The tail is just a batch with a smaller last batch: the plan still runs the full
        global batches (for loaders, backends and shard(); Grain's last batch is iteration's)."""
        t = [o for o in self._split.tail if o.kind != "to_iter_dataset"]
        return (self._split.head is not None and len(t) == 1 and t[0].kind == "batch"
                and t[0].args.get("batch_fn") is None)

    def _no_tail(self, what: str) -> None:
        if self._tail is not None and not self._remainder_only:
            raise PlanError(f"{what} needs the pipeline to end in the plan's global batch, but its "
                            f"last steps ({', '.join(o.kind for o in self._split.tail)}) run after "
                            "the plan (a smaller last batch, batch_fn, steps after batch or a Grain "
                            "iterator step). Iterate the dataset instead, or end it in "
                            "batch(B, drop_remainder=True).")

    def _past_the_end(self, index: int) -> Any:
        """Grain's MapDataset past its length: the next epoch (reshuffled, fresh random maps)."""
        if self._op.kind == "batch":
            parent = self._derive(self._op.parents[0], self._config)
            return Tail((self._op,), head_len=lambda: len(parent), head_item=parent._item,
                        head_iter=lambda: iter(parent), head_is_map=True, leaf=lambda o: None
                        ).item(index)
        if self._in_iter():
            raise PlanError(f"ds[{index}]: an IterDataset has no random access (as in Grain).")
        return self._derive(GraphOp("repeat", (self._op,), {"num_epochs": None}), self._config)._item(index)

    def _check_backend(self, what: str) -> Compiled:
        self._no_tail(what)
        c = self._compiled
        if not self.batched:
            raise PlanError(f"{what} emits global batches; add .batch(B) to the pipeline.")
        if not has_accumulator(c.transforms) and not all(t.one_to_one for t in row_ops(c.transforms)):
            raise PlanError(f"{what} with a filter is not available yet: the backend's loader "
                            "cannot stack Grain records for steps evaluated in several passes. "
                            "Iterate the dataset (numpy batches) or filter with a Map that marks "
                            "records instead.")
        return c

    def _backend_groups(self, kwargs: dict[str, Any], **where: Any) -> tuple[Where, How, dict[str, Any]]:
        """An emitter's `(where, how, rest)` from `to_jax`/`to_torch` keywords: `where=`/`how=`
        as given, else built from the loose keywords (`rank=`, `mesh=`, `prefetch=`, ...) over
        `where`'s defaults and the dataset's `runner()`/`read_ahead()`; `rest` is the emitter's own."""
        if "mesh_dims" in kwargs:  # torch's old name
            kwargs["batch_axes"] = kwargs.pop("mesh_dims")
        wk = {k: kwargs.pop(k) for k in list(kwargs) if k in _WHERE_FIELDS}
        hk = {k: kwargs.pop(k) for k in list(kwargs) if k in _HOW_FIELDS}
        w, h = kwargs.pop("where", None), kwargs.pop("how", None)
        if (w is not None and wk) or (h is not None and hk):
            raise PlanError(f"pass where=/how= or the keywords {sorted({**wk, **hk})}, not both")
        if w is None:
            w = Where(**({**where, **wk} if not wk.keys() & {"mesh", "sharding", "rank", "world"} else wk))
        if h is None:
            h = How(**{"runner": self._config.runner, "read_ahead": self._config.read_ahead, **hk})
        return w, h, kwargs

    def _shard(self) -> dict[str, Any]:
        """A torch emitter's rank/world: the dataset's `shard()`, else torch.distributed's."""
        return {} if self._config.world is None else {"rank": self._config.rank, "world": self._config.world}

    def _read_options(self, read_options: Any) -> Dataset:
        """Grain's `ReadOptions(num_threads=n)`: a Zephon threads runner of n workers."""
        ds = self._derive(self._op, self._config)
        if read_options is None or self._config.runner is not None or self._split.head is None:
            return ds
        return ds.runner(options_runner(ds.transforms, int(getattr(read_options, "num_threads", 0)), use_threads=True))

    def mp_prefetch(self, options: Any = None, worker_init_fn: Any = None) -> Dataset:
        """Grain's multiprocess prefetch: `options.num_workers` Zephon workers run the plan's
        steps (processes when the transforms pickle, else threads; the data is the same)."""
        if worker_init_fn is not None:
            raise PlanError("mp_prefetch(worker_init_fn=...) is not supported: Zephon's workers "
                            "run only the pipeline's transforms; initialise state inside them.")
        n = int((options or grain.MultiprocessingOptions()).num_workers)
        if self._split.head is None:
            return self._derive(self._op, self._config)
        head = self._derive(self._split.head, self._config)
        return self.runner(options_runner(head.transforms, n, use_threads=False))


def options_runner(transforms: Any, num_workers: int, *, use_threads: bool) -> Runner | None:
    """Grain's worker counts as a Zephon runner: processes when every transform pickles (as
    Grain's workers need), else threads — saying once that the process isolation is off."""
    if num_workers <= 0:
        return None
    if use_threads:
        return threads(num_workers)
    try:
        pickle.dumps(transforms)
    except Exception:
        warn_once("mp_prefetch:threads",
                  "mp_prefetch: the pipeline's transforms do not pickle (a lambda?), so its "
                  f"{num_workers} workers are threads, not processes (same data; Python-heavy "
                  "transforms run slower). Define them at module level for process workers.")
        return threads(num_workers)
    return processes(num_workers)

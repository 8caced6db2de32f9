"""`ZephonDataLoader`: a torch `DataLoader` with the StatefulDataLoader convention.

It counts the batches it *handed to the training loop* (not those prefetched by workers), so its
`state_dict()` resumes exactly after the last batch the model saw. Its workers also run pipelines
that change the number of records (filters, packing): each takes a block of the rank's lanes
(`ZephonIterableDataset.worker_rank`), and the loader joins their rows of every step
(`join_parts`) and merges their lanes' positions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, get_worker_info

from zephon.backends.torch.batch import TorchBatch, can_pin
from zephon.backends.torch.dataset import WorkerPart, ZephonIterableDataset
from zephon.errors import PlanError, StateError
from zephon.telemetry import Stats, Telemetry
from zephon.telemetry import make as telemetry_recorder
from zephon.telemetry import require as require_telemetry

log = logging.getLogger(__name__)


class _MarkParts:
    """worker_init_fn of a ZephonDataLoader: makes the worker's dataset copy yield `WorkerPart`s,
    then calls the user's worker_init_fn. Module-level, so spawned workers can unpickle it."""

    def __init__(self, user_fn: Any = None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        assert info is not None and isinstance(info.dataset, ZephonIterableDataset), "runs in a worker"
        info.dataset._parts = True
        if self.user_fn is not None:
            self.user_fn(worker_id)


def join_parts(parts: Sequence[WorkerPart], per_lane: int, pin: bool = False) -> TorchBatch:
    """The rows of all parts, in lane order (one concatenation per field); `per_lane` rows of
    every lane (the step's: a batch-size schedule changes it)."""
    if len(parts) == 1 and not pin:
        return TorchBatch(parts[0].data)
    lanes = np.concatenate([np.asarray(p.lanes, np.int64) for p in parts])
    order = np.argsort(lanes, kind="stable")
    rows = None
    if np.any(order != np.arange(len(order))):  # an interleaved mapping: workers hold every W-th lane
        rows = (order[:, None] * per_lane + np.arange(per_lane)).ravel()
    out: dict[str, Any] = {}
    joined: torch.Tensor | np.ndarray
    for k in parts[0].data:
        vs = [p.data[k] for p in parts]
        if isinstance(vs[0], torch.Tensor):
            shape = (sum(v.shape[0] for v in vs),) + tuple(vs[0].shape[1:])
            joined = torch.empty(shape, dtype=vs[0].dtype, pin_memory=pin and rows is None)
            torch.cat(vs, out=joined)
            if rows is not None:
                joined = joined[torch.from_numpy(rows)]
                if pin:
                    joined = joined.pin_memory()
        else:
            joined = np.concatenate(vs)
            if rows is not None:
                joined = joined[rows]
        out[k] = joined
    return TorchBatch(out)


class ZephonDataLoader(DataLoader):
    """A `DataLoader` over a `ZephonIterableDataset` with StatefulDataLoader-style state.

    `state_dict()` describes the batches handed to the training loop, not those workers have
    prefetched; `load_state_dict()` makes the next `iter()` continue from there. Over a finite
    plan every `iter()` is an epoch, as in torch: after the first, each starts the next pass —
    in the order `repeat()` gives it (reshuffled) — unless `set_epoch(e)` or `load_state_dict`
    chose where it starts; the state records the epoch. A plan that repeats forever spans all
    epochs itself, and iterating again continues where the last iteration stopped.

    With `num_workers=W > 0`, a one-to-one pipeline is split by step (worker w computes steps
    `start+w, start+w+W, ...`); a count-changing one (filter, flat map, packing) by lanes: worker
    w runs the w-th of W equal blocks of this rank's lanes (W must divide them) and reports their
    position with its rows; this loader joins the W parts of each step in lane order and keeps
    the merged position of the last batch it handed out. The batches are the same for every W.

    `stats()` (the dataset's `How(telemetry=...)`: on by default, False, or a
    `zephon.Telemetry(...)`) times how long the training loop waited for each batch (stall %)
    and sums the stage times every worker reports with its batches (read, ops, assembly, emit),
    so a stage that keeps its workers busy while the loop stalls is the one to give more workers.

    Its own arguments are torch `DataLoader`'s: `num_workers`, `pin_memory`, `timeout`,
    `worker_init_fn`, `multiprocessing_context`, `prefetch_factor` (batches each worker
    prepares ahead). `telemetry=` here is deprecated (it moved into the dataset's `How`) and
    works for this version with a `DeprecationWarning`.

    Batch-shaping options (`batch_size`, `sampler`, `collate_fn`, ...) do not exist: the plan
    decides batches. Workers are never persistent, so each `iter()` starts them at the cursor,
    and results stay in order.
    """

    def __init__(self, dataset: ZephonIterableDataset, *, num_workers: int = 0,
                 pin_memory: bool = False, timeout: float = 0, worker_init_fn: Any = None,
                 multiprocessing_context: Any = None, prefetch_factor: int | None = None,
                 telemetry: bool | Telemetry | None = None) -> None:
        if not isinstance(dataset, ZephonIterableDataset):
            raise PlanError(f"ZephonDataLoader needs a ZephonIterableDataset, got "
                            f"{type(dataset).__name__}; wrap your plan and sources in one.")
        if multiprocessing_context is None and num_workers > 0 and _fork_unsafe(dataset.sources):
            # a forked worker cannot read ArrayRecord after this process opened readers (its
            # thread pool does not survive fork): start workers from a clean server instead
            multiprocessing_context = "forkserver"
        parts = num_workers > 0 and not dataset.one_to_one
        if parts:
            dataset.worker_rank(0, num_workers)  # refuses a lane count the workers cannot split
            worker_init_fn = _MarkParts(worker_init_fn)
        super().__init__(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                         timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context,
                         prefetch_factor=prefetch_factor, persistent_workers=False, in_order=True)
        self._joins_parts = parts
        self._consumed = 0  # batches handed out by the newest iteration (one-to-one, or in-process)
        self._position: dict[str, Any] | None = None  # after the last joined batch (parts)
        self._generation = 0
        self._fresh = True  # the next iter() starts at the dataset's start, not the next epoch
        if telemetry is None:
            telemetry = dataset.telemetry_config
        else:
            warnings.warn("ZephonDataLoader(dataset, telemetry=...) is deprecated and will be removed in the "
                          "next version; use ZephonIterableDataset(pipeline, how=zephon.How(telemetry=...)).",
                          DeprecationWarning, stacklevel=2)
        n = dataset.plan.num_steps
        self._tel = telemetry_recorder(telemetry if dataset.telemetry else False,
                                       None if n is None else max(0, n - dataset.start_step))

    def _current(self) -> dict[str, Any]:
        """Position after the last batch handed out."""
        if self._position is not None:
            return self._position
        return self.dataset.position_after(self._consumed)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]
        ds: ZephonIterableDataset = self.dataset  # type: ignore[assignment]
        if not self._fresh and ds.finite:
            ds.start_epoch(ds.epoch + 1)
        elif self._consumed or self._position is not None:
            ds.continue_from(self._current())
        self._consumed, self._position = 0, None
        self._fresh = False
        if self._joins_parts:
            ds.settle(workers=True)  # the workers are told where the plan ends
        self._IterableDataset_len_called = None  # a len() of the last epoch is not this one's
        self._generation += 1
        if self._joins_parts:
            return self._joined(super().__iter__(), self._generation, ds.start_step)
        return self._counted(super().__iter__(), self._generation)

    def _superseded(self, generation: int) -> None:
        if generation != self._generation:
            raise StateError("this ZephonDataLoader iterator was superseded by a newer iter() or "
                             "load_state_dict(); state_dict() follows the newest one only, so "
                             "consume one iterator at a time.")

    def _counted(self, batches: Iterator[dict[str, Any]], generation: int) -> Iterator[dict[str, Any]]:
        tel = self._tel
        while True:
            t0 = tel.begin() if tel is not None else 0.0
            batch = next(batches, None)
            if batch is None:
                if tel is not None:
                    tel.end(t0, None)
                return
            self._superseded(generation)
            self._consumed += 1
            if tel is not None:
                self._report(tel, [batch])
                tel.end(t0, batch)
            yield batch

    @staticmethod
    def _report(tel: Telemetry, batches: Sequence[Any]) -> None:
        """Takes the stage times the producing workers attached to their batches."""
        for b in batches:
            snap = getattr(b, "telemetry", None)
            if snap is not None:
                worker, stages, nbytes, workers = snap
                tel.external(f"worker {worker}", stages, nbytes, workers)

    def stats(self) -> Stats:
        """Telemetry so far: the loop's stall %, the workers' stage times, rows/tokens/bytes, and
        what a dropping finite plan's end leaves (`unemitted`, counted where the end is)."""
        s = require_telemetry(self._tel, "this ZephonDataLoader").stats()
        main = getattr(self.dataset, "_main", None)  # the loader that counted the end, if any
        unemitted = getattr(main, "unemitted", None)
        if s.unemitted is None and unemitted is not None:
            s = dataclasses.replace(s, unemitted=unemitted)
        return s

    def _joined(self, parts: Iterator[WorkerPart], generation: int, step: int) -> Iterator[dict[str, Any]]:
        workers = self.num_workers
        pin = self.pin_memory and can_pin()
        plan = self.dataset.plan  # type: ignore[attr-defined]
        tel = self._tel
        while True:
            t0 = tel.begin() if tel is not None else 0.0
            group: list[WorkerPart] = []
            for w in range(workers):
                part = next(parts, None)
                if part is None or part.step != step or part.worker != w:
                    # the plan ended: a worker whose lanes ran out stopped, and DataLoader goes
                    # on with the others; the step is incomplete, as it is for one loader
                    if tel is not None:
                        tel.end(t0, None)
                    return
                group.append(part)
            self._superseded(generation)
            t1 = time.perf_counter()
            batch = join_parts(group, plan.per_lane_at(step), pin)
            if tel is not None:
                tel.add("assembly", time.perf_counter() - t1)
                self._report(tel, [p.data for p in group])
                tel.end(t0, batch)
            shift = group[0].position.get("lane_shift")  # a run resumed at another batch size
            self._position = {"step": step + 1,
                              "lanes": {k: v for p in group for k, v in p.position["lanes"].items()},
                              **({"lane_shift": shift} if shift else {}),
                              **({"epoch": group[0].position["epoch"]} if "epoch" in group[0].position else {})}
            step += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The Zephon state after the last batch handed out (see the module doc)."""
        return self.dataset.state_from(self._current())  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any], *, allow_batch_change: bool = False) -> None:
        """The next `iter()` continues after the batches `state` had handed out (a state of any
        emitter, saved at any data-parallel degree; merge every rank's with `merge_states`).
        `allow_batch_change=True` accepts a state saved under another global batch size (see
        `zephon.Loader.restore`)."""
        self.dataset.restore(state, allow_batch_change=allow_batch_change)  # type: ignore[attr-defined]
        self._consumed, self._position = 0, None
        self._generation += 1
        self._fresh = True

    def set_epoch(self, epoch: int) -> None:
        """The next `iter()` starts pass `epoch` over the finite plan (torch's convention)."""
        self.dataset.start_epoch(epoch)  # type: ignore[attr-defined]
        self._consumed, self._position = 0, None
        self._generation += 1
        self._fresh = True


def _fork_unsafe(sources: Any) -> bool:
    """Whether forked workers would read ArrayRecord after this process opened readers."""
    import multiprocessing as mp

    from zephon.sources.array_record import ArrayRecordSource, readers_opened

    items = sources.values() if isinstance(sources, Mapping) else (
        sources if isinstance(sources, (list, tuple)) else [sources])
    return (any(isinstance(s, ArrayRecordSource) for s in items) and readers_opened()
            and "forkserver" in mp.get_all_start_methods())

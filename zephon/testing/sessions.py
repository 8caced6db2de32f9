"""Sessions: one emitter (numpy `Loader`, the Grain-compatible iterator, `TorchLoader` /
`ZephonDataLoader`, `JaxLoader`) over every rank of one segment, in this process, stepping and
handing its state over through that emitter's own API. JAX, torch and Grain are imported only by
the sessions that use them."""

from __future__ import annotations

import copy
import io
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.loader import LocalBatch, merge_states
from zephon.pipeline import How, Where
from zephon.plan import Batching
from zephon.testing.configs import Segment
from zephon.testing.pipeline import Builder, Pipeline, backend_refusal

#: The XLA flag that gives a CPU process N fake devices (JAX meshes on one host).
FAKE_DEVICES_FLAG = "--xla_force_host_platform_device_count"


class NotApplicable(Exception):
    """This configuration cannot run this pipeline (reported as n/a, with the reason)."""


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


def _np_micro(batch: LocalBatch, n: int) -> dict[str, np.ndarray]:
    """The batch's rows as its `n` micro-batches (`LocalBatch.micro_batches`) concatenated back."""
    if n == 1:
        return dict(batch.data)
    parts = batch.micro_batches(n)
    return {k: np.concatenate([p.data[k] for p in parts]) for k in batch.data}


def runner_from_spec(spec: str, rank: int = 0) -> Any:
    """The runner `spec` names for rank `rank`'s loader: a new one, or — inside `shared_runners()`,
    for process runners — the pool's `processes` runner of that spec and rank, lent to one loader
    at a time (see `SharedRunners`)."""
    from zephon.runners import from_spec

    if spec == "inline":
        return None
    pool = _POOLS[-1] if _POOLS else None
    if pool is not None and spec.startswith("processes"):
        return pool.get(spec, rank)
    return from_spec(spec)


class _Lent:
    """A runner lent to one loader: `close()` (the loader's, at the end of a segment) leaves the
    workers running for the next loader; `SharedRunners.close` stops them."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def imap(self, fn: Any, items: Any) -> Any:
        return self._inner.imap(fn, items)

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:  # pickles, workers, depth, ...: the runner's
        return getattr(self._inner, name)

    def __reduce__(self) -> tuple[Any, ...]:  # a copy (a DataLoader worker's) is the runner's copy
        return (_same, (self._inner,))


def _same(x: Any) -> Any:
    return x


class SharedRunners:
    """Process runners kept across configurations: starting worker processes is most of what a
    short `processes:N` configuration costs, and which process computes a step cannot change it
    (the runner contract), so every configuration's rank `r` borrows the same `processes:N`
    runner. Each loader still pickles its own step function to the workers, which compute
    every step it asks for; only the process start is shared. Use as a context manager."""

    def __init__(self) -> None:
        self.runners: dict[tuple[str, int], Any] = {}

    def get(self, spec: str, rank: int) -> Any:
        from zephon.runners import from_spec

        key = (spec, rank)
        if key not in self.runners:
            self.runners[key] = from_spec(spec)
        return _Lent(self.runners[key])

    def close(self) -> None:
        for r in self.runners.values():
            r.close()
        self.runners.clear()

    def __enter__(self) -> SharedRunners:
        _POOLS.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _POOLS.remove(self)
        self.close()


_POOLS: list[SharedRunners] = []


def shared_runners() -> Any:
    """`with shared_runners():` — the pool in use if there is one (nested calls share it), else a
    new `SharedRunners` closed at the end of the block."""
    import contextlib

    return contextlib.nullcontext(_POOLS[-1]) if _POOLS else SharedRunners()


def degree_problem(pipe: Pipeline, world: int) -> str | None:
    """Why `pipe` cannot run at data-parallel degree `world` (reported as n/a), or None."""
    lanes = pipe.plan.lanes.count
    if lanes % world:
        return f"lanes={lanes} is not divisible by D={world}"
    return None


class _Session:
    """An emitter over every rank of one segment, in this process."""

    has_provenance = False

    def restore(self, state: dict[str, Any], allow_batch_change: bool = False) -> None:
        raise NotImplementedError

    def step(self) -> StepOut:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _NumpySession(_Session):
    has_provenance = True

    def __init__(self, pipes: list[Pipeline], seg: Segment, options: Mapping[str, Any] = {}) -> None:
        self.seg = seg
        self.loaders = [p.loader(Where(rank=r, world=seg.world), How(runner=runner_from_spec(seg.runner, r), **options))
                        for r, p in enumerate(pipes)]

    def restore(self, state: dict[str, Any], allow_batch_change: bool = False) -> None:
        for l in self.loaders:
            l.restore(state, allow_batch_change=allow_batch_change)

    def step(self) -> StepOut:
        batches = [next(l) for l in self.loaders]
        return StepOut([(b.lanes, _np_micro(b, self.seg.micro)) for b in batches],
                       [replace(b, data={}) for b in batches])

    def state(self) -> dict[str, Any]:
        return _json_round_trip(merge_states([l.state() for l in self.loaders]))

    def close(self) -> None:
        for l in self.loaders:
            l.close()


class _GrainSession(_Session):
    """The Grain-compatible iterator (`get_state`/`set_state`) over every rank."""

    def __init__(self, pipes: list[Pipeline], seg: Segment, options: Mapping[str, Any] = {}) -> None:
        import zephon.compat.grain as zg

        self.zg, self.seg = zg, seg
        self.iters = [zg.Iterator(p.loader(Where(rank=r, world=seg.world),
                                           How(runner=runner_from_spec(seg.runner, r), **options)),
                                  batched=True)
                      for r, p in enumerate(pipes)]

    def restore(self, state: dict[str, Any], allow_batch_change: bool = False) -> None:
        for it in self.iters:
            it.set_state(copy.deepcopy(state), allow_batch_change=allow_batch_change)

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


def torch_columns(batch: Any, micro: int) -> dict[str, np.ndarray]:
    """A torch batch as numpy columns; with `micro` > 1, through its `micro_batches(micro)`
    concatenated back."""
    if micro > 1:
        import torch

        parts = batch.micro_batches(micro)
        batch = {k: torch.cat([m[k] for m in parts]) if isinstance(batch[k], torch.Tensor)
                 else np.concatenate([m[k] for m in parts]) for k in batch}
    return {k: _torch_to_numpy(v) for k, v in batch.items()}


def torch_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """What `torch.save` + `torch.load(weights_only=True)` give back."""
    import torch

    buf = io.BytesIO()
    torch.save({"data": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["data"]


class _TorchSession(_Session):
    """`TorchLoader` per rank, or `ZephonDataLoader` with `workers` DataLoader workers."""

    def __init__(self, pipes: list[Pipeline], seg: Segment, options: Mapping[str, Any] = {}) -> None:
        from zephon.backends.torch import TorchLoader, ZephonDataLoader, ZephonIterableDataset

        self.seg = seg
        self.loaders: list[Any] = []
        self.iters: list[Any] = []
        for r, p in enumerate(pipes):
            if seg.workers:
                ds = ZephonIterableDataset(p, Where(rank=r, world=seg.world),
                                           How(runner=runner_from_spec(seg.runner, r), **options))
                # fork after JAX started its threads can deadlock: then start workers clean
                ctx = "forkserver" if "jax" in sys.modules else None
                self.loaders.append(ZephonDataLoader(ds, num_workers=seg.workers,
                                                     multiprocessing_context=ctx))
            else:
                self.loaders.append(TorchLoader(p, Where(rank=r, world=seg.world),
                                                How(runner=runner_from_spec(seg.runner, r), **options)))
        self.owned = [p.plan.lanes.owned(r, seg.world) for r, p in enumerate(pipes)]

    def _iter(self, r: int) -> Any:
        while len(self.iters) <= r:
            self.iters.append(None)
        if self.iters[r] is None:
            self.iters[r] = iter(self.loaders[r])
        return self.iters[r]

    def restore(self, state: dict[str, Any], allow_batch_change: bool = False) -> None:
        for l in self.loaders:
            l.load_state_dict(torch_round_trip(state), allow_batch_change=allow_batch_change)
        self._drop_iters()

    def step(self) -> StepOut:
        parts = []
        for r in range(len(self.loaders)):
            parts.append((self.owned[r], torch_columns(next(self._iter(r)), self.seg.micro)))
        return StepOut(parts)

    def state(self) -> dict[str, Any]:
        return merge_states([torch_round_trip(l.state_dict()) for l in self.loaders])

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


class JaxSession(_Session):
    """`JaxLoader` over a mesh of this process's devices (or of every process's, under
    jax.distributed); fields JAX cannot hold (bytes, text) are left out and not compared."""

    def __init__(self, pipe: Pipeline, seg: Segment, ref_dtypes: Mapping[str, np.dtype],
                 options: Mapping[str, Any] = {}) -> None:
        import jax
        from jax.sharding import Mesh

        from zephon.backends.jax import JaxLoader, jax_holds_dtype

        shape = tuple(seg.mesh or (8,))
        need = math.prod(shape)
        if jax.device_count() < need:
            raise NotApplicable(f"mesh {'x'.join(map(str, shape))} needs {need} devices, JAX has "
                                 f"{jax.device_count()} (set XLA_FLAGS={FAKE_DEVICES_FLAG}=8 before jax "
                                 "is imported, e.g. in conftest.py)")
        names = ("data", "fsdp", "model", "x4")[:len(shape)]
        mesh = Mesh(np.array(jax.devices()[:need]).reshape(shape), names)
        self.seg, self.ref_dtypes = seg, dict(ref_dtypes)
        self.excluded = sorted(k for k, d in ref_dtypes.items()
                               if d.kind in "OUS" or (d.kind == "V" and not jax_holds_dtype(d)))
        self.plan = pipe.plan
        self.loader = JaxLoader(pipe, Where(mesh=mesh, batch_axes=names),
                                How(runner=runner_from_spec(seg.runner), **options), exclude=self.excluded)
        self.owned = pipe.plan.lanes.owned(self.loader.layout.rank, self.loader.layout.world)

    def restore(self, state: dict[str, Any], allow_batch_change: bool = False) -> None:
        self.loader.restore(state, allow_batch_change=allow_batch_change)

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


def emitter_session(builder: Builder, seg: Segment, ref_dtypes: Mapping[str, np.dtype], batch: int | None = None,
                    options: Mapping[str, Any] = {}) -> _Session:
    """The emitter of `seg` over all its ranks (at global batch size `batch`, if given; loader
    `options` such as `read_ahead`, which change speed, never data). A PlanError while building
    it (the pipeline built fine for the reference) means this emitter cannot take the pipeline:
    n/a, with the reason."""
    pipes = [builder(seg.degree, r) for r in range(seg.degree if builder.takes_rank else 1)]
    if batch is not None:
        try:
            pipes = [replace(p, plan=Batching(p.plan.lanes, batch, remainder=p.plan.remainder)) for p in pipes]
        except PlanError as e:
            raise NotApplicable(str(e)) from e
    try:
        return _make_session(builder, pipes, seg, ref_dtypes, options)
    except PlanError as e:
        raise NotApplicable(str(e)) from e


def _make_session(builder: Builder, pipes: list[Pipeline], seg: Segment,
                  ref_dtypes: Mapping[str, np.dtype], options: Mapping[str, Any] = {}) -> _Session:
    why = degree_problem(pipes[0], seg.degree)
    if why:
        raise NotApplicable(why)
    if not builder.takes_rank:
        pipes = pipes * seg.degree
    if seg.micro > 1:
        plan = pipes[0].plan
        shards = math.prod(seg.mesh or (8,)) if seg.backend == "jax" else seg.degree
        for step, size in plan.sizes.stretches():
            held = size // shards
            if size % shards == 0 and held % seg.micro:
                raise NotApplicable(f"micro={seg.micro} does not divide the {held} row(s) each "
                                     f"{'device' if seg.backend == 'jax' else 'rank'} holds"
                                     f"{f' from step {step}' if step else ''}")
    if seg.backend in ("jax", "torch"):
        why = backend_refusal(pipes[0])
        if why:
            raise NotApplicable(why)
    if seg.backend == "numpy":
        return _NumpySession(pipes, seg, options)
    if seg.backend == "grain":
        return _GrainSession(pipes, seg, options)
    if seg.backend == "torch":
        return _TorchSession(pipes, seg, options)
    return JaxSession(pipes[0], seg, ref_dtypes, options)

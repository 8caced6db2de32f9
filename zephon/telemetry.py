"""Telemetry: does the training loop wait for data, and which stage would more workers help?

Every emitter keeps a `Telemetry` recorder (on by default, `telemetry=False` turns it off) and
answers `stats()` with a `Stats` snapshot:

- **stall**: per step, the time the caller's `next()` blocked (`wait_s`) against the time the
  caller spent between two `next()` calls (`between_s`, its train step). `stall_pct` is
  `wait / (wait + between)` over every step after the first; the first batch (start-up
  included) is `first_batch_s`.
- **stages**: busy seconds of `read` (sources' reads), `ops` (row operators, in groups/windows),
  `assembly` (lanes assembled in order, accumulators, one-to-one transforms on the consumer)
  and `emit` (the backend's conversion and transfer). Reads and row operators run on the
  runner's workers, so their seconds are summed over `workers` and `busy_pct` divides by
  `wall_s × workers`: a stage near 100 % while `stall_pct` is high is the one to give more
  workers (`threads(n)` / `processes(n)` for read and ops; `prefetch` for emit).
- **counts**: steps, rows, tokens (elements of the `tokens` or `input_ids` field emitted),
  bytes read (the size of the columns the sources returned).

Timing costs a few clock reads per step and per group read; it never touches the data, so the
batches are the same with telemetry on and off. `log_every=seconds` logs a summary through
`logging` (logger `zephon.telemetry`, level INFO) at most that often; `progress=True` shows a
tqdm bar (with an ETA when the plan has a length).

Terms (docs/glossary.md): telemetry, stall, sink.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

STAGES = ("read", "ops", "assembly", "emit")
#: Fields whose elements count as tokens.
TOKEN_FIELDS = ("tokens", "input_ids")


@dataclass(frozen=True)
class Stats:
    """One snapshot of an emitter's telemetry (see the module doc for each field)."""

    steps: int
    rows: int
    tokens: int
    bytes_read: int
    wall_s: float
    wait_s: float
    between_s: float
    first_batch_s: float
    stages: dict[str, float] = field(default_factory=dict)
    workers: int = 1
    #: what a finite plan's end leaves unemitted (`zephon.exec.end.Unemitted`: rows, tokens,
    #: share), once the loader knows it — `remainder="drop"` with count-changing pipelines only
    unemitted: Any = None

    @property
    def stall_pct(self) -> float:
        """Share of the caller's time (after the first batch) spent waiting in `next()`."""
        total = self.wait_s + self.between_s
        return 100.0 * self.wait_s / total if total > 0 else 0.0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def busy_pct(self, stage: str) -> float:
        """A stage's busy seconds over the time its threads had (`wall_s`, times `workers` for
        the stages the runner's workers run)."""
        lanes = self.workers if stage in ("read", "ops") else 1
        return 100.0 * self.stages.get(stage, 0.0) / (self.wall_s * lanes) if self.wall_s > 0 else 0.0

    def bottleneck(self) -> str | None:
        """The busiest stage, or None before the first step."""
        if not self.steps:
            return None
        return max(STAGES, key=self.busy_pct)

    def summary(self) -> str:
        """One line: step, stall, throughput, stage times, bytes — what the periodic log prints."""
        stages = " ".join(f"{s} {self.stages.get(s, 0.0):.3g}s ({self.busy_pct(s):.0f}%)" for s in STAGES)
        return (f"step {self.steps}: stall {self.stall_pct:.1f}% | {self.rows_per_s:,.0f} rows/s "
                f"{self.tokens_per_s:,.0f} tokens/s | {stages} busy on {self.workers} worker(s) | "
                f"{self.bytes_read / 1e6:,.1f} MB read | first batch {self.first_batch_s:.2f}s")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(stall_pct=self.stall_pct, rows_per_s=self.rows_per_s, tokens_per_s=self.tokens_per_s,
                   busy_pct={s: self.busy_pct(s) for s in STAGES})
        return out


def column_bytes(cols: Mapping[str, np.ndarray]) -> int:
    """Bytes held by columns: `nbytes` of fixed-size arrays; of object arrays, the items' sizes
    (bytes/str lengths or nested arrays' nbytes, judged by the first item)."""
    total = 0
    for v in cols.values():
        if v.dtype != object:
            total += v.nbytes
        elif v.size:
            flat = v.reshape(-1)
            first = flat[0]
            if isinstance(first, np.ndarray):
                total += sum(x.nbytes for x in flat if isinstance(x, np.ndarray))
            elif isinstance(first, (bytes, str)):
                total += sum(map(len, flat))
    return total


def _leading(nest: Any) -> int:
    """The leading dimension of the first array in a nest of dicts, lists and tuples."""
    while isinstance(nest, (Mapping, list, tuple)):
        items = list(nest.values()) if isinstance(nest, Mapping) else nest
        if not items:
            return 0
        nest = items[0]
    shape = getattr(nest, "shape", None)
    return int(shape[0]) if shape else 0


def count_tokens(cols: Mapping[str, Any]) -> int:
    """Elements of the first token field present (0 when there is none)."""
    for name in TOKEN_FIELDS:
        v = cols.get(name)
        if v is None:
            continue
        if type(v) is np.ndarray and v.dtype != object:  # the common case, first and cheap
            return v.size
        if isinstance(v, np.ndarray) and v.dtype == object:
            return int(sum(np.size(x) for x in np.asarray(v).reshape(-1)))
        size = getattr(v, "size", None)  # numpy; torch's size is a method: numel
        return int(v.numel() if callable(size) else size if size is not None else np.size(v))
    return 0


class Telemetry:
    """Counters and clocks of one emitter; `stats()` reads them.

    Args:
      log_every: seconds between summaries logged at INFO (None: never).
      progress: show a tqdm progress bar (needs `tqdm`; its ETA when `total` is known).
      total: steps the iteration will take, for the bar (emitters fill it in from the plan).

    The emitter calls `begin()` when its `next()` is entered and `end(t0, cols)` before it
    returns; stages report with `add(stage, seconds)` (thread-safe: a prefetch thread or the
    consumer may add). Inner recorders (`include`) contribute their stages and bytes, so an
    emitter wrapping a `Loader` reports the loader's stages and its own emit time.
    """

    def __init__(self, log_every: float | None = None, progress: bool = False,
                 total: int | None = None) -> None:
        if log_every is not None and not log_every > 0:
            raise ValueError(f"log_every must be a positive number of seconds or None, got {log_every!r}")
        self.log_every = log_every
        self.progress = bool(progress)
        self.total = total
        self.workers = 1
        self._lock = threading.Lock()
        self._stages = dict.fromkeys(STAGES, 0.0)
        self._inner: list[Telemetry] = []
        self._external: dict[str, tuple[dict[str, float], int, int]] = {}
        self._bar: Any = None
        #: set by the loader: what the plan's end leaves unemitted (see `Stats.unemitted`)
        self.unemitted: Any = None
        self.reset()

    def reset(self) -> None:
        """Starts counting afresh (stage times and counts too)."""
        with self._lock:
            self._stages = dict.fromkeys(STAGES, 0.0)
            self._external = {}
        self.steps = self.rows = self.tokens = self.bytes_read = 0
        self.wait_s = self.between_s = self.first_batch_s = 0.0
        self._start: float | None = None
        self._last_end: float | None = None
        self._next_log = 0.0
        for inner in self._inner:
            inner.reset()

    def include(self, inner: Telemetry) -> None:
        """Adds an inner recorder's stages, bytes and workers to this one's `stats()`."""
        self._inner.append(inner)

    def add(self, stage: str, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self._stages[stage] += seconds
            self.bytes_read += nbytes

    def begin(self) -> float:
        now = time.perf_counter()
        if self._start is None:
            self._start = now
        elif self._last_end is not None:
            self.between_s += now - self._last_end
        return now

    def end(self, t0: float, cols: Any, rows: int | None = None) -> None:
        """Closes a step that began at `t0` and yielded `cols` (None: no batch, e.g. the end):
        a mapping of fields, or any nest of arrays (rows: the first leaf's length)."""
        now = time.perf_counter()
        if cols is None:
            self._last_end = now
            return
        if self.steps == 0:
            self.first_batch_s = now - t0
        else:
            self.wait_s += now - t0
        self.steps += 1
        if rows is None:
            rows = _leading(cols)
        self.rows += rows
        if isinstance(cols, Mapping):
            self.tokens += count_tokens(cols)
        self._last_end = now
        if self._bar is not None or self.progress:
            self._tick()
        if self.log_every is not None and now >= self._next_log:
            if self.steps > 1:
                log.info("%s", self.stats().summary())
            self._next_log = now + self.log_every

    def step(self, produce: Callable[[], Any]) -> Any:
        """Times one `next()` of an emitter: `produce()` returns the batch or raises
        StopIteration."""
        t0 = self.begin()
        try:
            out = produce()
        except StopIteration:
            self.end(t0, None)
            raise
        self.end(t0, out)
        return out

    def timed(self, stage: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, its seconds added to `stage`."""
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.add(stage, time.perf_counter() - t0)
        return out

    def snapshot(self) -> tuple[dict[str, float], int, int]:
        """(stage seconds, bytes read, workers) of this recorder and its inner ones: what a
        worker process sends with its batches (`external` on the receiving side)."""
        s = self.stats()
        return s.stages, s.bytes_read, s.workers

    def external(self, key: str, stages: Mapping[str, float], nbytes: int, workers: int) -> None:
        """The latest cumulative snapshot of another process (`key`, e.g. a DataLoader worker):
        `stats()` adds every key's stages and bytes, and their workers."""
        with self._lock:
            self._external[key] = (dict(stages), int(nbytes), int(workers))

    def _tick(self) -> None:
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, unit="batch", desc="zephon", dynamic_ncols=True)
        self._bar.update(1)
        if self.steps % 16 == 1:
            self._bar.set_postfix(stall=f"{self.stall_pct_now():.1f}%", refresh=False)

    def stall_pct_now(self) -> float:
        total = self.wait_s + self.between_s
        return 100.0 * self.wait_s / total if total > 0 else 0.0

    def close(self) -> None:
        """Closes the progress bar (if any)."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def stats(self) -> Stats:
        with self._lock:
            stages = dict(self._stages)
            external = list(self._external.values())
        nbytes, workers = self.bytes_read, self.workers
        if external:
            workers = sum(w for _, _, w in external)
            for ext_stages, ext_bytes, _ in external:
                for k, v in ext_stages.items():
                    stages[k] = stages.get(k, 0.0) + v
                nbytes += ext_bytes
        for inner in self._inner:
            sub = inner.stats()
            for k, v in sub.stages.items():
                stages[k] += v
            nbytes += sub.bytes_read
            workers = max(workers, sub.workers)
        wall = (self._last_end - self._start) if self._start is not None and self._last_end is not None else 0.0
        unemitted = self.unemitted
        for inner in self._inner:
            unemitted = unemitted if unemitted is not None else inner.unemitted
        return Stats(self.steps, self.rows, self.tokens, nbytes, wall, self.wait_s, self.between_s,
                     self.first_batch_s, stages, workers, unemitted)


def make(option: bool | Telemetry | None, total: int | None = None, workers: int = 1) -> Telemetry | None:
    """An emitter's recorder from its `telemetry=` argument: True (default) -> a new one,
    False/None -> none, a `Telemetry` -> that one (its `total` filled in when unset)."""
    if option is None or option is False:
        return None
    if option is True:
        option = Telemetry(total=total)
    if isinstance(option, Telemetry):
        if option.total is None:
            option.total = total
        option.workers = int(workers)
        return option
    raise TypeError(f"telemetry must be True, False or a zephon.Telemetry, got {type(option).__name__}")


class StageSink:
    """A Loader's link to its recorder. Group reads and lane windows report their read and
    row-operator seconds and bytes here (`sink(result, waited)`, from the consumer's thread);
    `step` times one `next()` and counts as assembly the part of it that did not wait for them.
    """

    def __init__(self, tel: Telemetry) -> None:
        self.tel = tel
        self.waited = 0.0

    def __call__(self, result: Any, waited: float) -> None:
        self.tel.add("read", result.read_s, result.nbytes)
        self.tel.add("ops", result.ops_s)
        self.waited += waited

    def step(self, produce: Callable[[], Any]) -> Any:
        tel = self.tel
        t0, waited = tel.begin(), self.waited
        try:
            batch = produce()
        except StopIteration:
            tel.end(t0, None)
            raise
        tel.add("assembly", max(0.0, time.perf_counter() - t0 - (self.waited - waited)))
        tel.end(t0, batch.data, batch.rows)
        return batch


def require(tel: Telemetry | None, what: str) -> Telemetry:
    """The emitter's recorder, or a clear error when it was built with telemetry=False."""
    if tel is None:
        from zephon.errors import PlanError

        raise PlanError(f"{what} was built with telemetry=False, so it has no stats(); build it with "
                        "telemetry=True (the default) or telemetry=zephon.Telemetry(...).")
    return tel

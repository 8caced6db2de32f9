"""Running configurations and comparing them with the reference (numpy, D=1): `run_config`,
`divergence` (the first differing step, lane, row and field, with `explain` of that row) and
`verify`, which runs a list of configurations into a `zephon.testing.report.Report`."""

from __future__ import annotations

import copy
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zephon.errors import PlanError
from zephon.exec.loader import LocalBatch
from zephon.fingerprints import Divergence, StepRecord, compare_steps, describe_row, lane_records, record_fingerprint
from zephon.testing.configs import BACKENDS, REFERENCE, Config, end_resume
from zephon.testing.pipeline import Builder, Factory
from zephon.testing.processes import run_processes
from zephon.testing.report import Report, RunResult
from zephon.testing.sessions import NotApplicable, emitter_session, shared_runners


@dataclass
class Run:
    """What a configuration produced: per step, lane records; provenance where available."""

    records: list[StepRecord] = field(default_factory=list)
    batches: list[list[LocalBatch] | None] = field(default_factory=list)
    excluded: frozenset[str] = frozenset()
    plan_fingerprint: str = ""
    plan_json: Any = None
    dtypes: dict[str, np.dtype] = field(default_factory=dict)


#: Optional dependencies a configuration may need, and the extra that installs each: without
#: it the configuration does not apply here (n/a), it does not differ.
_EXTRAS = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "grain": "grain", "tokenizers": "lm",
           "tensorflow_datasets": "tfds", "torchdata": "torch"}


def _missing_extra(e: BaseException) -> str | None:
    """'X is not installed: pip install zephon-loader[extra]' when `e` is an optional dependency that is
    missing, else None."""
    if not isinstance(e, ModuleNotFoundError):
        return None
    extra = _EXTRAS.get((e.name or "").split(".")[0])
    return None if extra is None else f"{e.name} is not installed: pip install 'zephon-loader[{extra}]'"


@dataclass
class _Stopped:
    """A run up to a stop, and the state saved there: what configurations that stop the same way share."""

    records: list[StepRecord]
    batches: list[list[LocalBatch] | None]
    excluded: frozenset[str]
    dtypes: dict[str, np.dtype]
    state: dict[str, Any]


def run_config(builder: Builder, config: Config, steps: int, *, ref_dtypes: Mapping[str, np.dtype] = {},
               keep_batches: bool = False, timeout: float = 600.0, on_step: Callable[[], None] | None = None,
               stops: dict[tuple[str, int], _Stopped] | None = None) -> Run:
    """Runs `config` for `steps` global steps. Raises `NotApplicable` when it cannot run.

    `stops` (a dict this function fills) shares the segments before a stop between
    configurations that run them alike: the first to stop after, say, `numpy D=8 @5` runs those
    steps and saves the state; the others take its step records and resume from a copy of that
    state (the same document, saved through the same emitter's API: running it again could only
    give it again, the loader being deterministic, which the repeated reference checks)."""
    run = Run()
    state: dict[str, Any] | None = None
    first = builder(config.segments[0].degree, 0)
    run.plan_fingerprint, run.plan_json = first.plan.fingerprint(), first.plan.to_json()
    batch: int | None = None  # the global batch size a `B=` segment resumed at (and kept)
    for i, seg in enumerate(config.segments):
        resized = seg.batch is not None and seg.batch != batch
        batch = seg.batch if seg.batch is not None else batch
        stop = steps if seg.until is None else min(seg.until, steps)
        last = i == len(config.segments) - 1
        key = (" -> ".join(s.label() for s in config.segments[:i + 1]) + f" read_ahead={config.read_ahead}", stop)
        if stops is not None and not last and key in stops:
            got = stops[key]
            run.records, run.batches = list(got.records), list(got.batches)
            run.excluded, run.dtypes = got.excluded, dict(got.dtypes)
            state = copy.deepcopy(got.state)
            for _ in range(len(run.records)):
                if on_step is not None:
                    on_step()
            continue
        if seg.procs > 1:
            recs, state, excluded = run_processes(builder, seg, len(run.records), stop, state,
                                                   ref_dtypes, timeout)
            run.records += recs
            run.batches += [None] * len(recs)
            run.excluded |= frozenset(excluded)
            continue
        options = {} if config.read_ahead is None else {"read_ahead": config.read_ahead}
        sess = emitter_session(builder, seg, ref_dtypes, batch, options)
        try:
            run.excluded |= frozenset(getattr(sess, "excluded", ()))
            if state is not None:
                sess.restore(state, allow_batch_change=resized)
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
                if stops is not None:
                    stops[key] = _Stopped(list(run.records), list(run.batches), run.excluded,
                                          dict(run.dtypes), copy.deepcopy(state))
        finally:
            sess.close()
    return run


def _first(run: Run, n: int) -> Run:
    """`run`'s first `n` steps (a configuration that runs fewer steps than the reference)."""
    if len(run.records) <= n:
        return run
    return Run(run.records[:n], run.batches[:n], run.excluded, run.plan_fingerprint, run.plan_json, run.dtypes)


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


def lane_stream_divergence(ref: Run, run: Run) -> Divergence | None:
    """Where a lane of `run` (a resume at another batch size) stops continuing the reference's
    rows of that lane: every lane must emit the same rows in the same order whatever the batch
    size, so a row skipped or repeated at the resume shows here (None: every lane continued)."""
    def streams(r: Run) -> dict[int, dict[str, list[tuple[str, int]]]]:
        out: dict[int, dict[str, list[tuple[str, int]]]] = {}
        for step, rec in enumerate(r.records):
            for lane, lr in rec.items():
                for name, (_, rows) in lr.fields.items():
                    out.setdefault(lane, {}).setdefault(name, []).extend((d, step) for d in rows)
        return out

    a, b = streams(ref), streams(run)
    for lane in sorted(a):
        for name in sorted(set(a[lane]) - run.excluded):
            x, y = a[lane][name], b.get(lane, {}).get(name, [])
            bad = next((j for j in range(min(len(x), len(y))) if x[j][0] != y[j][0]), None)
            if bad is not None:
                return Divergence(y[bad][1], lane, None, name,
                                  f"the {bad}-th row lane {lane} emitted differs from the lane's row "
                                  "in the reference: the lane did not continue where it stopped at "
                                  "the change of batch size (a row skipped or repeated)")
    return None


def _reference(builder: Builder, steps: int) -> tuple[Run, dict[str, np.dtype]]:
    ref = run_config(builder, REFERENCE, steps, keep_batches=True)
    if not ref.records:
        raise PlanError("the pipeline produced no global batch; check its plan and sources")
    return ref, ref.dtypes


def verify(factory: Factory, configs: Iterable[Config | str], steps: int = 20, *,
           progress: bool = False, name: str | None = None, timeout: float = 600.0,
           near_end: bool = True) -> Report:
    """Runs the reference (numpy, D=1) and every configuration for `steps` steps (a
    configuration's own `steps`, if it has one: compared with the reference's first steps) and
    reports how each compares. Never raises for a difference (see `Report.ok`); raises
    `FactoryError` / `PlanError` when the pipeline itself cannot be built or run.

    A finite pipeline that ends within `steps` is run to its end by every configuration: one
    that ends at another step, or pads otherwise, differs. With `near_end`, such a pipeline is
    also stopped two steps before its end and resumed at another degree and emitter
    (`end_resume`).

    What is shared between configurations (see `run_config` and `SharedRunners`): the steps
    before a stop that several configurations make alike, and the worker processes of the
    `processes:N` runners."""
    builder = factory if isinstance(factory, Builder) else Builder(factory)
    parsed = [Config.parse(c) if isinstance(c, str) else c for c in configs]
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps + sum(min(c.steps or steps, steps) for c in parsed), desc=name or builder.name,
                   unit="step", leave=False, dynamic_ncols=True)
    tick = (lambda: bar.update(1)) if bar is not None else None
    stops: dict[tuple[str, int], _Stopped] = {}
    try:
        with shared_runners():
            results, ref = _verify(builder, parsed, steps, bar, tick, stops, timeout, near_end)
    finally:
        if bar is not None:
            bar.close()
    return Report(name or builder.name, len(ref.records), results, ref.plan_fingerprint,
                  time.perf_counter() - t0)


def _verify(builder: Builder, parsed: list[Config], steps: int, bar: Any, tick: Callable[[], None] | None,
            stops: dict[tuple[str, int], _Stopped], timeout: float, near_end: bool
            ) -> tuple[list[RunResult], Run]:
    t = time.perf_counter()
    ref, dtypes = _reference(builder, steps)
    if bar is not None:
        bar.update(steps)
    ref_fps = [record_fingerprint(r) for r in ref.records]
    finite = len(ref.records) < steps  # the reference ended: every run must end there too
    if finite and near_end:
        extra = end_resume(len(ref.records), [b for b in BACKENDS if any(
            seg.backend == b for c in parsed for seg in c.segments)] or ["numpy"])
        parsed = parsed + extra
        if bar is not None:
            bar.total += steps * len(extra)
    batch_refs: dict[Config, Run] = {}  # numpy D=1 under each set of batch-size changes
    results = [RunResult(REFERENCE.name + " (reference)", "identical", len(ref.records), ref_fps,
                         [True] * len(ref.records), seconds=time.perf_counter() - t)]
    for cfg in parsed:
        if bar is not None:
            bar.set_postfix_str(cfg.name[:40])
        t = time.perf_counter()
        done = 0
        # steps this configuration runs: its own (compared with the reference's first steps), or
        # the run's (a finite pipeline: to its end, which must be the reference's)
        n = min(cfg.steps, steps) if cfg.steps is not None else (steps if finite else len(ref.records))
        own = _first(ref, n)

        def count() -> None:
            nonlocal done
            done += 1
            if tick is not None:
                tick()

        base, note = own, ""
        try:
            if cfg.changes_batch:  # compared with numpy D=1 under the same changes, whose lanes
                key = cfg.batch_reference()  # must continue the reference's rows
                if key not in batch_refs:
                    batch_refs[key] = run_config(builder, key, n, ref_dtypes=dtypes, keep_batches=True,
                                                 stops=stops)
                base = batch_refs[key]
                note = f"compared with {key.name}"
            run = run_config(builder, cfg, n, ref_dtypes=dtypes, keep_batches=True, timeout=timeout,
                             on_step=count, stops=stops)
        except NotApplicable as e:
            results.append(RunResult(cfg.name, "n/a", note=str(e), seconds=time.perf_counter() - t))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            missing = _missing_extra(e)
            if missing is not None:
                results.append(RunResult(cfg.name, "n/a", note=missing, seconds=time.perf_counter() - t))
                continue
            results.append(RunResult(cfg.name, "error", note=f"{type(e).__name__}: {e}",
                                     seconds=time.perf_counter() - t,
                                     detail="".join(traceback.format_exception(e)[-4:])))
        else:
            div, matches = divergence(base, run)
            if base is not own:
                div = lane_stream_divergence(ref, base) or div
            fps = [record_fingerprint(r) for r in run.records]
            if run.excluded:
                note = "; ".join(x for x in (note, f"not compared: {', '.join(sorted(run.excluded))} "
                                                  "(JAX cannot hold them)") if x)
            results.append(RunResult(cfg.name, "identical" if div is None else "differs",
                                     len(run.records), fps, matches, div, note,
                                     time.perf_counter() - t))
        finally:
            if bar is not None:
                bar.update(max(0, n - done))
    return results, ref

"""Configurations: a `Segment` (an emitter, degree, runner, micro-batch count, mesh, workers,
processes, global batch size, until a step), a `Config` (segments with a stop/save/resume between
them, parsed from text like `numpy D=2 @10 -> jax mesh=2x4`, or `... -> numpy D=8 B=64` for a
resume at another global batch size), the default `matrix` of them (one dimension at a time) and
`cross_matrix` (the dimensions crossed: emitter x D x runner, and stop at one emitter/D/micro
-> resume at another, with batch-size changes)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from zephon.errors import PlanError

BACKENDS = ("numpy", "jax", "torch", "grain")


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
    batch: int | None = None        # resume at this global batch size (allow_batch_change)

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
        if self.batch is not None and (not isinstance(self.batch, int) or self.batch < 1):
            raise PlanError(f"B={self.batch!r} must be a positive integer (a global batch size)")
        if self.batch is not None and self.procs > 1:
            raise PlanError("B= (a resume at another global batch size) runs in this process; drop procs=")
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
        if self.batch is not None:
            out.append(f"B={self.batch}")
        if self.until is not None:
            out.append(f"@{self.until}")
        return " ".join(out)


@dataclass(frozen=True)
class Config:
    """A way to run the pipeline: one segment, or several with a stop/save/resume between them."""

    segments: tuple[Segment, ...]
    note: str = ""
    steps: int | None = None        # global steps this configuration runs (None: the run's `steps`)
    read_ahead: int | None = None   # the loaders' read_ahead (rows a read aims for; None: theirs)

    @property
    def name(self) -> str:
        return " -> ".join(s.label() for s in self.segments) + (f" ({self.note})" if self.note else "")

    def __str__(self) -> str:
        return self.name

    @property
    def changes_batch(self) -> bool:
        """Whether a segment resumes at another global batch size (`B=`)."""
        return any(s.batch is not None for s in self.segments)

    def batch_reference(self) -> Config:
        """numpy D=1 with the same stops and batch sizes: what this configuration must equal."""
        return Config(tuple(Segment(until=s.until, batch=s.batch) for s in self.segments), steps=self.steps,
                      read_ahead=self.read_ahead)

    @staticmethod
    def parse(text: str) -> Config:
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
                                    "micro=2, mesh=2x4, workers=2, procs=2, B=64) or @STEP")
                key = {"D": "world", "d": "world", "world": "world", "B": "batch", "b": "batch"}.get(key, key)
                if key == "mesh":
                    kw["mesh"] = tuple(_int(x, w, text) for x in val.lower().split("x"))
                elif key == "runner":
                    kw["runner"] = val
                elif key in ("world", "micro", "workers", "procs", "batch"):
                    kw[key] = _int(val, w, text)
                else:
                    raise PlanError(f"unknown option {key!r} in configuration {text!r}; use D, runner, "
                                    "micro, mesh, workers, procs, B")
            segs.append(Segment(**kw))
        for s in segs[:-1]:
            if s.until is None:
                raise PlanError(f"configuration {text!r}: every segment but the last needs @STEP, "
                                "the step to stop and save at")
        if segs[0].batch is not None:
            raise PlanError(f"configuration {text!r}: B= resumes at another global batch size, so it "
                            "goes on a segment after '->' (the first runs the factory's plan)")
        if segs[-1].until is not None:
            raise PlanError(f"configuration {text!r}: the last segment runs to the end; drop its @STEP")
        stops = [s.until for s in segs[:-1] if s.until is not None]  # all of them (checked above)
        if stops != sorted(set(stops)) or (stops and stops[0] < 1):
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
    texts = [f"numpy D=2 @{a} -> numpy D=8"]
    if b > a:  # two stops need two distinct steps (not so in a 2- or 3-step run)
        texts.append(f"numpy D=8 @{a} -> numpy D=1 @{b} -> numpy D=4 micro=2")
    if "jax" in bk and "torch" in bk:
        texts.append(f"jax mesh=8 @{b} -> torch D=2 micro=2")
    if "torch" in bk and "grain" in bk:
        texts.append(f"torch D=4 @{a} -> grain D=1")
    if "grain" in bk and "jax" in bk:
        texts.append(f"grain D=2 @{b} -> jax mesh=2x4 micro=2")
    if "torch" in bk:
        texts.append(f"torch D=2 workers=2 @{a} -> numpy D=4")
    return [Config.parse(t) for t in texts if steps > b]


def end_resume(end: int, backends: Sequence[str] = BACKENDS) -> list[Config]:
    """For a finite pipeline of `end` steps: stop two steps before its end, resume at another
    degree (and emitter), run to the end."""
    at = end - 2
    if at < 1:
        return []
    bk = [x for x in ("numpy", "torch", "jax") if x in backends] or ["numpy"]
    texts = [f"numpy D=2 @{at} -> numpy D=8"]
    if "torch" in bk:
        texts.append(f"torch D=4 @{at} -> numpy D=1")
    if "jax" in bk:
        texts.append(f"numpy D=8 @{at} -> jax mesh=2x4")
    return [replace(Config.parse(t), note="near the end") for t in texts]


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
            found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*->\s*(\d+)\s*", spec)
            if not found:
                raise PlanError(f"resume {spec!r}: write STEP:D1->D2, e.g. 10:2->8 (stop after step 10 "
                                "at D=2, resume at D=8)")
            at, d1, d2_ = (int(x) for x in found.groups())
            if not 0 < at < steps:
                raise PlanError(f"resume {spec!r}: the stop {at} must be inside the run (1..{steps - 1})")
            b1, b2 = backends[i % len(backends)], backends[(i + 1) % len(backends)]
            s1 = Segment(b1, world=1 if b1 == "jax" else d1, until=at, mesh=(8,) if b1 == "jax" else None)
            s2 = Segment(b2, world=1 if b2 == "jax" else d2_, mesh=(8,) if b2 == "jax" else None)
            out.append(Config((s1, s2)))
    return out


def placements(backends: Sequence[str] = BACKENDS, degrees: Sequence[int] = (1, 2, 4, 8),
               meshes: Sequence[tuple[int, ...]] = ((8,), (4, 2), (2, 4))) -> list[Segment]:
    """Every emitter at every degree (JAX: at every mesh): where a segment can run."""
    out: list[Segment] = []
    for b in backends:
        out += ([Segment("jax", mesh=tuple(m)) for m in meshes] if b == "jax"
                else [Segment(b, world=d) for d in degrees])
    return out


def cross_matrix(steps: int, *, batch: int | None = None, backends: Sequence[str] = BACKENDS,
                 degrees: Sequence[int] = (1, 2, 4, 8), runners: Sequence[str] = ("threads:2", "processes:2"),
                 micro: int = 2, meshes: Sequence[tuple[int, ...]] = ((8,), (4, 2), (2, 4)),
                 resumes: int = 2, read_ahead: int | None = None, skip: Sequence[str] = ()) -> list[Config]:
    """The dimensions crossed, each configuration `steps` steps long (a short run: its point is
    the combination, and a resume compares the steps after it):

    - emitter x degree x runner: every placement (`placements`) under every runner;
    - stop/resume across emitter x degree x micro-batches x batch size: every placement stops at
      `steps // 2` (micro-batches on every other one, runners rotating) and resumes `resumes`
      times, on emitters rotating through `backends` (the j-th placement of an emitter resumes on
      the j-th, j+1-th, ... emitter: with 2 resumes every ordered pair of emitters occurs at
      least once), at a degree (mesh) rotating so that the pairs of degrees vary, micro-batches
      on alternate resumes, and — where `batch`, the pipeline's global batch size, is given —
      every other resume at another global batch size (twice, then half of it, alternately;
      `allow_batch_change`).

    Each reads `read_ahead` rows at a time (default: the pipeline's global batch size `batch`):
    a loader's default (16384 rows) would read ahead hundreds of steps at D=8, most of the cost
    of a 10-step run; a read of about one global batch puts several reads, and the joins between
    them, inside the run (read_ahead changes speed, never data: that is checked too).
    Configurations named in `skip` (those `matrix` runs already) are left out.
    """
    rows = read_ahead if read_ahead is not None else batch
    if steps < 2:
        raise PlanError(f"the cross-product needs at least 2 steps (a stop and a step after it), got {steps}")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise PlanError(f"unknown backends {unknown}; choose among {', '.join(BACKENDS)}")
    places = placements(backends, degrees, meshes)
    out: list[Config] = []
    for p in places:
        out += [Config((replace(p, runner=r),), steps=steps, read_ahead=rows) for r in runners]
    cycle = ["inline", *runners]
    at = steps // 2
    nth: dict[str, int] = {}
    changes = 0
    for i, p1 in enumerate(places):
        j = nth[p1.backend] = nth.get(p1.backend, -1) + 1
        first = replace(p1, micro=micro if i % 2 else 1, runner=cycle[i % len(cycle)], until=at)
        for k in range(min(resumes, len(backends))):
            b2 = backends[(j + k) % len(backends)]
            cands = [p for p in places if p.backend == b2 and p != p1]
            if not cands:
                continue
            p2 = cands[(i + 2 * k + 1) % len(cands)]
            size = None
            if batch and (i + k) % 2 == 1:
                size = batch * 2 if changes % 2 == 0 else batch // 2
                changes += 1
            second = replace(p2, micro=micro if (i + k) % 2 == 0 else 1,
                             runner=cycle[(i + k + 1) % len(cycle)], batch=size or None)
            out.append(Config((first, second), steps=steps, read_ahead=rows))
    seen = set(skip)
    unique = []
    for c in out:
        if c.name not in seen:
            seen.add(c.name)
            unique.append(c)
    return unique

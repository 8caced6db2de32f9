"""One-call assertions: `assert_elastic`, `assert_runners_agree`, `assert_emitters_agree`,
`assert_resumes`, `assert_micro_batches`, `assert_deterministic`. Each runs `verify` and raises
`DeterminismError` (an AssertionError) with the report when a configuration differs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from zephon.testing.configs import REFERENCE, Config, Segment, matrix
from zephon.testing.pipeline import Builder, Factory
from zephon.testing.report import Report
from zephon.testing.runs import verify


class DeterminismError(AssertionError):
    """A configuration of the pipeline produced other batches than the reference."""


def raise_if_failed(report: Report, what: str) -> Report:
    """`report` if every configuration agreed; else a `DeterminismError` naming `what` and the
    first configurations that diverged (the one-call assertions and the pytest plugin end here)."""
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
    return raise_if_failed(verify(b, [Config((Segment(world=d),)) for d in _degrees(b, degrees) if d > 1] or
                         [replace(REFERENCE, note="second run")], steps), "not elastic")


def assert_runners_agree(factory: Factory, runners: Sequence[str] = ("threads:2", "processes:2"),
                         world: int = 2, steps: int = 20) -> Report:
    """Runners and worker counts change nothing (processes need picklable, module-level operators)."""
    return raise_if_failed(verify(factory, [Config((Segment(world=world, runner=r),)) for r in runners], steps),
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
    return raise_if_failed(verify(factory, configs, steps), "emitters disagree")


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
    return raise_if_failed(verify(b, configs, steps), "resume changes the batches")


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
    return raise_if_failed(verify(factory, configs, steps), "micro-batches change the data")


def assert_deterministic(factory: Factory, steps: int = 20, **options: Any) -> Report:
    """The whole default matrix (`matrix(...)` options): degrees, runners, emitters, micro-batches,
    two local processes, stop/resume across degrees and emitters, and a repeated reference run."""
    return raise_if_failed(verify(factory, matrix(steps=steps, **options), steps), "not deterministic")

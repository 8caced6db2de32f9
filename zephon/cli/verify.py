"""`zephon verify`: a user's pipeline (MODULE:FACTORY, path/file.py:FACTORY or a plan's JSON)
under the configuration matrix the options choose, a table and summary per pipeline, a JSON
report and a heat map; exit 0 only when every configuration is identical."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from zephon.cli.pipelines import DEMO_PIPELINES
from zephon.cli.usage import UsageError
from zephon.errors import PlanError

VERIFY_HELP = """\
Runs a pipeline under a matrix of configurations and compares every global step, lane by lane
and row by row, with the reference: the numpy emitter at D=1. Exits 0 only when every
configuration is identical (1 when one differs or fails, 2 on a usage error), so it can gate CI.

TARGET is what to verify (several may be given; none: the demo pipelines):
  MODULE:FACTORY          e.g. my_project.data:pipeline (importable from here)
  path/to/file.py:FACTORY a file outside any package
  plan.json               a saved plan (plan.canonical_json(), or a saved state): its rows'
                          (source, record) are verified without the data; Grain-compatible
                          plans too
The factory takes no arguments (or world=, rank= if your code reads them: then a pipeline that
changes with D is caught) and returns a zephon.testing.Pipeline(plan, sources, transforms),
a tuple (plan, sources[, transforms]) or a zephon.compat.grain Dataset ending in .batch(B).

The matrix, one dimension at a time: every backend at every degree (JAX: every mesh, 8 fake
CPU devices), the runners at D=2, torch DataLoader workers, micro-batch counts on every
backend, 2 local processes (jax.distributed, torch gloo), stop/resume across degrees and
emitters (each state saved through that emitter's API, JSON/torch.save round-tripped, merged
over ranks), and the reference once more (catches global RNG). Configurations a pipeline
cannot take (D not dividing the lanes, ...) are listed as n/a with the reason. A plan with a
batch-size schedule runs like any other; `B=N` on a segment after a stop resumes it at global
batch size N (allow_batch_change): compared with numpy D=1 under the same changes, whose every
lane must continue the reference's rows where it stopped.

Then the cross-product, --cross-steps steps each (default 10; 0: none): every emitter x degree
(JAX: mesh) under each runner, and every placement stopping at half the steps and resuming on
other emitters and degrees, with micro-batches and batch-size changes. Configurations that stop
alike share the steps before the stop; processes:N workers are started once and lent to each
loader.

Report: a table per pipeline, a summary line, and with --report PATH a JSON file and a PNG
heat map (configurations x steps; red where a step differs). --baseline PATH.json compares
every configuration also in a saved report step by step with its fingerprints (exit 1 naming
the first configuration and step that differ): record one before a change, compare after it.

examples:
  zephon verify                                         # the demo pipelines (make verify)
  zephon verify my_project.data:pipeline --steps 50
  zephon verify examples/verify_pipeline.py:pipeline --backends numpy,torch --degrees 1,2,4
  zephon verify my_project.data:pipeline --resume 10:2->8,25:8->1 --processes 0
  zephon verify my_project.data:pipeline --only --config "numpy D=2 @10 -> jax mesh=2x4 micro=2"
  zephon verify my_project.data:pipeline --config "numpy D=2 @10 -> torch D=4 B=512"
  zephon verify plan.json --backends numpy --steps 100
  zephon verify --steps 80 --report build/before        # before a change ...
  zephon verify --steps 80 --baseline build/before.json # ... and after it: the same fingerprints
"""

def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what} {text!r}: give comma-separated integers, e.g. 1,2,4,8") from None
    if any(x < 0 for x in out):
        raise UsageError(f"--{what} {text!r}: the numbers must not be negative")
    return out


def _meshes(text: str) -> list[tuple[int, ...]]:
    out = []
    for m in text.split(","):
        try:
            shape = tuple(int(x) for x in m.lower().split("x"))
        except ValueError:
            raise UsageError(f"--meshes {text!r}: write shapes like 8,4x2,2x4") from None
        if not shape or any(x < 1 for x in shape):
            raise UsageError(f"--meshes {text!r}: {m!r} is not a mesh shape")
        out.append(shape)
    return out


def verify_configs(args: argparse.Namespace) -> list[Any]:
    """The configurations the options ask for (see `zephon verify --help`)."""
    from zephon.testing import BACKENDS, Config, matrix

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise UsageError(f"--backends {args.backends!r}: choose among {','.join(BACKENDS)}")
    runners = [r.strip() for r in args.runners.split(",") if r.strip() and r.strip() != "none"]
    from zephon.runners import from_spec

    for r in runners:
        try:
            closer = from_spec(r)
            getattr(closer, "close", lambda: None)()
        except ValueError as e:
            raise UsageError(f"--runners: {e}") from None
    resume = None if args.resume is None else [x for x in args.resume.split(",") if x.strip()]
    configs = [] if args.only else matrix(
        steps=args.steps, backends=backends, degrees=_ints(args.degrees, "degrees") or [1],
        runners=runners, workers=_ints(args.workers, "workers"), micro=_ints(args.micro, "micro"),
        meshes=_meshes(args.meshes), procs=args.processes, resume=resume, repeat=True)
    try:
        configs += [Config.parse(c) for c in args.config or ()]
    except PlanError as e:
        raise UsageError(f"--config: {e}") from None
    if not configs:
        raise UsageError("no configuration to run: --only needs at least one --config")
    return configs


def _cross(args: argparse.Namespace, builder: Any, configs: list[Any]) -> list[Any]:
    """The cross-product for this pipeline (`--cross-steps`; none with --only or 0)."""
    if args.only or not args.cross_steps:
        return []
    from zephon.testing.configs import cross_matrix

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    runners = [r.strip() for r in args.runners.split(",") if r.strip() and r.strip() != "none"]
    micro = next((m for m in _ints(args.micro, "micro") if m > 1), 1)
    return cross_matrix(min(args.cross_steps, args.steps), batch=int(builder(1, 0).plan.size), backends=backends,
                        degrees=_ints(args.degrees, "degrees") or [1], runners=runners, micro=micro,
                        meshes=_meshes(args.meshes), skip=[c.name for c in configs])


def cmd_verify(args: argparse.Namespace) -> int:
    from zephon.testing import Builder, verify
    from zephon.testing.baseline import BaselineError, compare_baseline, load_baseline
    from zephon.testing.report import write_heatmap
    from zephon.testing.sessions import SharedRunners

    if args.steps < 2:
        raise UsageError(f"--steps {args.steps}: run at least 2 steps")
    if args.cross_steps and args.cross_steps < 2:
        raise UsageError(f"--cross-steps {args.cross_steps}: run at least 2 steps (a stop and one after "
                         "it), or 0 for no cross-product")
    saved = None
    if args.baseline:
        try:
            saved = load_baseline(args.baseline)
        except BaselineError as e:
            raise UsageError(str(e)) from None
    configs = verify_configs(args)
    targets = args.targets or list(DEMO_PIPELINES)
    builders = []
    for t in targets:  # every target is built once before anything runs: mistakes surface first
        builder = Builder(t)
        builder(1, 0)
        builders.append(builder)
    t0 = time.perf_counter()
    reports = []
    with SharedRunners():  # processes:N workers started once for every pipeline
        for t, b in zip(targets, builders):
            name = t if not t.startswith("zephon.cli:") else t.split(":")[1]
            cross = _cross(args, b, configs)
            if not args.quiet:
                more = f" + {len(cross)} x {args.cross_steps} steps (the cross-product)" if cross else ""
                print(f"\n== {name}: {len(configs) + 1} configurations x {args.steps} steps{more}", flush=True)
            rep = verify(b, configs + cross, args.steps, progress=not args.no_progress, name=name,
                         timeout=args.timeout)
            reports.append(rep)
            if not args.quiet:
                print(rep.table())
            print(rep.summary(), flush=True)
    wall = time.perf_counter() - t0
    ok = all(r.ok for r in reports)
    total = sum(len([x for x in r.results if x.status != "n/a"]) for r in reports)
    na = sum(len([x for x in r.results if x.status == "n/a"]) for r in reports)
    steps = sum(x.steps for r in reports for x in r.results if x.status != "n/a")
    line = (f"zephon verify: {len(reports)} pipeline{'s' if len(reports) > 1 else ''}, {total} "
            f"configurations, {steps} steps (up to {args.steps} a configuration"
            + (f", {args.cross_steps} in the cross-product" if args.cross_steps and not args.only else "")
            + f"{f'; {na} not applicable' if na else ''}): "
            + ("ALL IDENTICAL" if ok else "DIFFERENCES FOUND (see above)") + f" in {wall:.0f} s")
    base = None
    if saved is not None:
        base = compare_baseline(reports, saved, args.baseline, requested=args.steps)
        for m in base.mismatches:
            print(f"BASELINE: {m}")
        ok = ok and base.ok
    if args.report:
        out = Path(args.report)
        if out.parent and not out.parent.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"zephon_verify": 1, "ok": ok, "seconds": round(wall, 1), "summary": line,
               "steps": args.steps, "cross_steps": args.cross_steps,
               "baseline": None if base is None else base.summary(),
               "pipelines": [r.to_json() for r in reports]}
        Path(f"{out}.json").write_text(json.dumps(doc, indent=1))
        try:
            write_heatmap(reports, f"{out}.png")
            line += f"; report: {out}.json, {out}.png"
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "matplotlib":
                raise
            line += f"; report: {out}.json (no PNG: the heat map needs matplotlib, pip install 'zephon-loader[plots]')"
    print(line)
    if base is not None:
        print(base.summary())
    return 0 if ok else 1


def register(sub: Any) -> None:
    """Adds this command's parser to the `zephon` subcommands."""
    v = sub.add_parser("verify", help="prove it on YOUR pipeline: the configuration matrix, exit 0 only if identical",
                       description=VERIFY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("targets", nargs="*", metavar="TARGET", help="MODULE:FACTORY, path/file.py:FACTORY or plan.json")
    v.add_argument("--steps", type=int, default=40, help="global steps per configuration (default 40)")
    v.add_argument("--backends", default="numpy,jax,torch,grain",
                   help="emitters to compare (default numpy,jax,torch,grain; grain = the Grain-compatible iterator)")
    v.add_argument("--degrees", default="1,2,4,8", help="data-parallel degrees D (default 1,2,4,8)")
    v.add_argument("--runners", default="threads:2,processes:2",
                   help="runners at D=2 (default threads:2,processes:2; 'none' for none)")
    v.add_argument("--workers", default="2", help="torch DataLoader worker counts (default 2; 0 for none)")
    v.add_argument("--micro", default="2,4", help="micro-batch counts (default 2,4)")
    v.add_argument("--meshes", default="8,4x2,2x4", help="JAX mesh shapes over 8 devices (default 8,4x2,2x4)")
    v.add_argument("--processes", type=int, default=2,
                   help="local processes for the jax.distributed and torch gloo runs (default 2; 0 for none)")
    v.add_argument("--resume", default=None, metavar="STEP:D1->D2,...",
                   help="stop after STEP at D1, save, resume at D2 (emitters rotate over --backends); "
                        "default: stops at 1/3 and 1/2 of the run across degrees and emitters")
    v.add_argument("--config", action="append", metavar="CONFIG",
                   help="an extra configuration, e.g. \"torch D=4 micro=2\" or \"numpy D=2 @10 -> jax mesh=2x4\" "
                        "or \"numpy D=2 @10 -> numpy D=8 B=512\" (a resume at another global batch size; repeatable)")
    v.add_argument("--cross-steps", type=int, default=10, metavar="N",
                   help="also run the cross-product (emitter x D x runner; stop at one emitter/D/micro, "
                        "resume at another, with batch-size changes), N steps a configuration, stopping "
                        "at N/2 (default 10; 0: none)")
    v.add_argument("--baseline", default=None, metavar="PATH.json",
                   help="compare every configuration also in this saved report (--report's PATH.json) "
                        "step by step with its saved fingerprints; exit 1 naming the first that differs")
    v.add_argument("--only", action="store_true", help="run only the --config configurations")
    v.add_argument("--report", default=None, metavar="PATH",
                   help="write PATH.json (every configuration's fingerprints and result) and PATH.png (heat map)")
    v.add_argument("--timeout", type=float, default=600.0, help="seconds for a multi-process run (default 600)")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.add_argument("--quiet", action="store_true", help="print the summary lines only")
    v.set_defaults(fn=cmd_verify)

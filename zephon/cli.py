"""zephon — an elastically deterministic data loader: the global batches are a pure function of
the plan and the step, whatever the number of devices, hosts, workers, the micro-batch size, the
backend (numpy, JAX, PyTorch) or a stop/resume.

commands:
  demo      prove it on generated data: ArrayRecord, a filter, a tokenized, mixed, packed LM
            pipeline — D = 1, 2, 4, 8 and stop/resume at another D (about a minute)
  verify    prove it on YOUR pipeline: run it under a matrix of configurations (backends,
            degrees, runners, micro-batches, 2 processes, resume) and compare every step;
            exits 0 only when every configuration is identical, so it can gate CI
  explain   which record — or which document pieces, for packed rows — sits at every row of
            a global batch
  bench     throughput against Grain and the raw ArrayRecord limit (about 13 minutes)

examples:
  zephon demo
  zephon verify my_project.data:pipeline
  zephon verify examples/verify_pipeline.py:pipeline --backends numpy,torch --steps 30
  zephon explain plan.json --step 3
  zephon explain examples/verify_pipeline.py:packed --step 5 --rows 0:2

`zephon COMMAND --help` describes a command's options.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from zephon.checkpoint import load_state, save_state
from zephon.errors import PlanError, ZephonError
from zephon.exec.loader import Loader, merge_states
from zephon.plan import Batch, Source
from zephon.sources import ArrayRecordSource, FixedFields, write_sharded_array_record
from zephon.ops import Filter, Transform
from zephon.verify import first_mismatch, run_fingerprints

SPEC = FixedFields({"tokens": ("int32", (32,)), "id": ("int64", ())})


def make_dataset(directory: str | os.PathLike[str], records: int, shards: int = 4) -> ArrayRecordSource:
    """A small generated ArrayRecord data set: record i holds id i and 32 tokens derived from i."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=(records, 32), dtype=np.int32)
    payload = [SPEC.encode({"tokens": tokens[i], "id": i}) for i in range(records)]
    prefix = Path(directory) / "demo.array_record"
    write_sharded_array_record(prefix, payload, shards)
    return ArrayRecordSource(f"{prefix}@{shards}", SPEC)


@dataclass(frozen=True)
class Run:
    name: str
    fingerprints: list[str]


def _loaders(plan: Batch, src: Any, world: int, transforms: Sequence[Transform],
             **options: Any) -> list[Loader]:
    return [Loader(plan, src, transforms, rank=r, world=world, **options) for r in range(world)]


def resumed_run(plan: Batch, src: Any, steps: int, stop: int, world_before: int,
                world_after: int, transforms: Sequence[Transform], state_dir: str,
                **options: Any) -> list[str]:
    """Runs `stop` steps at one degree, checkpoints every rank's state, resumes at another."""
    before = _loaders(plan, src, world_before, transforms, **options)
    fps = run_fingerprints(before, stop)
    path = os.path.join(state_dir, f"state-{world_before}-{world_after}.json")
    save_state(path, merge_states([l.state() for l in before]))
    after = _loaders(plan, src, world_after, transforms, **options)
    for l in after:
        l.restore(load_state(path))
    return fps + run_fingerprints(after, steps - stop)


def matrix(plan: Batch, src: Any, steps: int, transforms: Sequence[Transform],
           state_dir: str, extra: Sequence[tuple[str, Callable[[], list[str]]]] = (),
           **options: Any) -> list[Run]:
    from tqdm import tqdm

    jobs: list[tuple[str, Callable[[], list[str]]]] = [
        (f"D={d}", lambda d=d: run_fingerprints(_loaders(plan, src, d, transforms, **options), steps))
        for d in (1, 2, 4, 8)]
    jobs.append(("D=2 stop@half -> resume at D=8", lambda: resumed_run(
        plan, src, steps, steps // 2, 2, 8, transforms, state_dir, **options)))
    jobs.append(("D=8 stop@third -> resume at D=1", lambda: resumed_run(
        plan, src, steps, steps // 3, 8, 1, transforms, state_dir, **options)))
    jobs += list(extra)
    runs = []
    for name, job in tqdm(jobs, desc="configurations", unit="cfg"):
        runs.append(Run(name, job()))
    return runs


def print_table(title: str, runs: list[Run]) -> bool:
    ref = runs[0].fingerprints
    print(f"\n{title}")
    print(f"  {'configuration':<36} {'steps':>5}  {'last step fingerprint':<34} identical")
    ok = True
    for r in runs:
        bad = first_mismatch(ref, r.fingerprints)
        ok &= bad is None
        verdict = "yes" if bad is None else f"NO (first difference at step {bad})"
        print(f"  {r.name:<36} {len(r.fingerprints):>5}  {r.fingerprints[-1]:<34} {verdict}")
    return ok


def cmd_demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="zephon-demo-") as tmp:
        src = make_dataset(tmp, args.records)
        plan = Source(len(src), name="demo").shuffle(args.seed).repeat().lanes(8).batch(64)
        print(f"Data: {len(src)} generated records in 4 ArrayRecord shards under {tmp}")
        print(f"Plan: {plan.canonical_json()}\nPlan fingerprint: {plan.fingerprint()}")
        print("\nGlobal batch 0, first rows (zephon explain):")
        print("\n".join(plan.explain_text(0).splitlines()[:5]))
        ok = print_table("1) shuffle + repeat, 8 lanes, global batch 64",
                         matrix(plan, src, args.steps, (), tmp))
        keep = Filter(lambda r: int(r["tokens"][0]) % 4 != 0, name="demo.keep_3_of_4")  # a count-changing step: lanes carry cursors
        ok &= print_table("2) same plan + a filter (per-lane cursors carried in the state)",
                          matrix(plan, src, args.steps, (keep,), tmp))
        ok &= lm_demo(tmp, args.steps)
    print("\n" + ("PROVED: the same global batches for D = 1, 2, 4, 8 data-parallel ranks and across "
                  "stop/resume at a different D — also for online tokenization, token-weighted "
                  "mixing and packing." if ok else "FAILED: fingerprints differ (see above)."))
    return 0 if ok else 1


def lm_demo(tmp: str, steps: int) -> bool:
    """Two generated corpora (prose, code) as JSONL, a BPE trained here, mixed 70/30 by tokens
    inside every lane, tokenized online and packed into rows of 256 tokens."""
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.plan import Mix
    from zephon.sources import JsonlSource
    from zephon.textdata import EOS_ID, generate_corpus, train_bpe, write_jsonl

    prose, code = generate_corpus(400, seed=1), generate_corpus(300, seed=2, style="code")
    write_jsonl(Path(tmp) / "prose.jsonl", prose)
    write_jsonl(Path(tmp) / "code.jsonl", code)
    tok = train_bpe(prose[:200] + code[:150], vocab_size=2000)
    srcs = [JsonlSource(str(Path(tmp) / "prose.jsonl")), JsonlSource(str(Path(tmp) / "code.jsonl"))]
    plan = Mix([Source(len(prose), id=0, name="prose").shuffle(1).repeat(),
                Source(len(code), id=1, name="code").shuffle(2).repeat()], [0.7, 0.3],
               by="tokens").lanes(8).batch(16)
    ops = (Tokenize(tok, eos=EOS_ID), Pack(256, "concat"))
    first = next(Loader(plan, srcs, ops))
    pad = float((first.data["segment_ids"] == 0).mean())
    print(f"\nLM pretraining: 2 JSONL corpora mixed 0.7/0.3 by tokens in every lane, BPE "
          f"tokenized online, packed to 16 x 256 (padding {pad:.1%}); row 0 holds "
          f"{len(first.segments[0])} document pieces, e.g. {first.explain()[0]['segments'][0]}")
    return print_table("3) tokenize + token-weighted mix + concat packing",
                       matrix(plan, srcs, steps, ops, tmp))


# --- the demo pipelines `zephon verify` checks by default (importable: also in other processes) ----

def _demo_dir() -> Path:
    """Generated demo data, made once per machine and reused (ZEPHON_DEMO_DATA moves it)."""
    root = Path(os.environ.get("ZEPHON_DEMO_DATA") or Path(tempfile.gettempdir()) / f"zephon-demo-data-{os.getuid()}")
    final = root / "v1"
    if (final / "done").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="building-", dir=root))
    try:
        make_dataset(tmp, 4096)
        from zephon.textdata import generate_corpus, train_bpe, write_jsonl

        prose, code = generate_corpus(400, seed=1), generate_corpus(300, seed=2, style="code")
        write_jsonl(tmp / "prose.jsonl", prose)
        write_jsonl(tmp / "code.jsonl", code)
        train_bpe(prose[:200] + code[:150], vocab_size=2000).save(str(tmp / "tokenizer.json"))
        (tmp / "done").write_text("ok")
        try:
            os.rename(tmp, final)
        except OSError:  # another process made it first
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _keep_3_of_4(cols: Any) -> Any:
    return cols["tokens"][:, 0] % 4 != 0


def demo_shuffle() -> Any:
    """Generated ArrayRecord data (4 shards), shuffled, repeated, 8 lanes dealt *interleaved*."""
    from zephon.testing import Pipeline

    src = ArrayRecordSource(f"{_demo_dir() / 'demo.array_record'}@4", SPEC)
    return Pipeline(Source(len(src), name="demo").shuffle(7).repeat().lanes(8, "interleaved").batch(64), src)


def demo_filter() -> Any:
    """The same data through a filter keeping 3 records of 4: lanes advance by the data."""
    from zephon.testing import Pipeline

    src = ArrayRecordSource(f"{_demo_dir() / 'demo.array_record'}@4", SPEC)
    keep = Filter(_keep_3_of_4, batched=True, name="demo.keep_3_of_4")
    return Pipeline(Source(len(src), name="demo").shuffle(8).repeat().lanes(8).batch(64), src, [keep])


def demo_lm() -> Any:
    """Two JSONL corpora mixed 0.7/0.3 by tokens in every lane, BPE-tokenized online, packed
    into rows of 256 tokens (concat-then-split): the LM pretraining pipeline."""
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.plan import Mix
    from zephon.sources import JsonlSource
    from zephon.testing import Pipeline
    from zephon.textdata import EOS_ID

    d = _demo_dir()
    srcs = [JsonlSource(str(d / "prose.jsonl")), JsonlSource(str(d / "code.jsonl"))]
    plan = Mix([Source(400, id=0, name="prose").shuffle(1).repeat(),
                Source(300, id=1, name="code").shuffle(2).repeat()], [0.7, 0.3],
               by="tokens").lanes(8).batch(16)
    return Pipeline(plan, srcs, [Tokenize(str(d / "tokenizer.json"), eos=EOS_ID), Pack(256, "concat")])


DEMO_PIPELINES = ("zephon.cli:demo_shuffle", "zephon.cli:demo_filter", "zephon.cli:demo_lm")


# --- explain ---------------------------------------------------------------------------------------

def _row_range(text: str | None, n: int) -> range:
    if text is None:
        return range(min(n, 16))
    a, sep, b = text.partition(":")
    try:
        lo = int(a) if a else 0
        hi = (int(b) if b else n) if sep else lo + 1
    except ValueError:
        raise UsageError(f"--rows {text!r}: write A:B (rows A..B-1), A: or A") from None
    if not 0 <= lo < hi <= n:
        raise UsageError(f"--rows {text!r} is outside the batch's rows 0..{n - 1}")
    return range(lo, hi)


def _is_plan_target(target: str) -> bool:
    return target.lstrip().startswith("{") or target.endswith(".json") or (
        os.path.isfile(target) and ":" not in Path(target).name)


def cmd_explain(args: argparse.Namespace) -> int:
    from zephon.testing import Builder, load_plan

    if args.step < 0:
        raise UsageError(f"--step {args.step}: steps count global batches from 0")
    if _is_plan_target(args.target):
        plan = load_plan(args.target)
        rows = plan.explain(args.step)
        sel = _row_range(args.rows, len(rows))
        print(f"{'row':>5} {'lane':>5} {'source':>6} {'record':>14} {'epoch':>6}")
        for j in sel:
            r = rows[j]
            print(f"{r['row']:>5} {r['lane']:>5} {r['source']:>6} {r['record']:>14} {r['epoch']:>6}")
        if args.rows is None and len(rows) > len(sel):
            print(f"... {len(rows) - len(sel)} more rows (--rows A:B to choose)")
        return 0
    pipe = Builder(args.target)(args.world, args.rank)
    loader = pipe.loader(rank=args.rank, world=args.world)
    try:
        if loader.random_access:
            batch = loader.batch(args.step)
        else:  # lanes advance by the data: run up to the step
            from tqdm import tqdm

            for _ in tqdm(range(args.step), desc=f"running to step {args.step}", unit="step",
                          leave=False, disable=args.step < 50):
                next(loader)
            batch = next(loader)
    finally:
        loader.close()
    rows = batch.explain()
    sel = _row_range(args.rows, len(rows))
    print(f"global batch {args.step}, rank {args.rank} of {args.world}: {len(rows)} rows of "
          f"{batch.global_rows}; plan {pipe.plan.fingerprint()}")
    for j in sel:
        r = rows[j]
        if "segments" in r:
            toks = sum(s["tokens"][1] - s["tokens"][0] for s in r["segments"])
            print(f"row {r['row']:>4}  lane {r['lane']:>3}  {len(r['segments'])} piece(s), {toks} tokens:")
            for s in r["segments"]:
                print(f"    source {s['source']:>2}  record {s['record']:>10}  epoch {s['epoch']:>3}  "
                      f"tokens {s['tokens'][0]}:{s['tokens'][1]}")
        else:
            print(f"row {r['row']:>4}  lane {r['lane']:>3}  source {r.get('source', '?'):>2}  "
                  f"record {r.get('record', '?'):>10}  epoch {r.get('epoch', '?'):>3}")
    if args.rows is None and len(rows) > len(sel):
        print(f"... {len(rows) - len(sel)} more rows (--rows A:B to choose)")
    return 0


# --- verify ----------------------------------------------------------------------------------------

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


def cmd_verify(args: argparse.Namespace) -> int:
    from zephon.testing import Builder, verify
    from zephon.verify import write_heatmap

    if args.steps < 2:
        raise UsageError(f"--steps {args.steps}: run at least 2 steps")
    configs = verify_configs(args)
    targets = args.targets or list(DEMO_PIPELINES)
    builders = []
    for t in targets:  # every target is built once before anything runs: mistakes surface first
        builder = Builder(t)
        builder(1, 0)
        builders.append(builder)
    t0 = time.perf_counter()
    reports = []
    for t, b in zip(targets, builders):
        name = t if not t.startswith("zephon.cli:") else t.split(":")[1]
        if not args.quiet:
            print(f"\n== {name}: {len(configs) + 1} configurations x {args.steps} steps", flush=True)
        rep = verify(b, configs, args.steps, progress=not args.no_progress, name=name,
                     timeout=args.timeout)
        reports.append(rep)
        if not args.quiet:
            print(rep.table())
        print(rep.summary(), flush=True)
    wall = time.perf_counter() - t0
    ok = all(r.ok for r in reports)
    total = sum(len([x for x in r.results if x.status != "n/a"]) for r in reports)
    line = (f"zephon verify: {len(reports)} pipeline{'s' if len(reports) > 1 else ''}, {total} "
            f"configurations, {args.steps} steps each: "
            + ("ALL IDENTICAL" if ok else "DIFFERENCES FOUND (see above)") + f" in {wall:.0f} s")
    if args.report:
        out = Path(args.report)
        if out.parent and not out.parent.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"zephon_verify": 1, "ok": ok, "seconds": round(wall, 1), "summary": line,
               "pipelines": [r.to_json() for r in reports]}
        Path(f"{out}.json").write_text(json.dumps(doc, indent=1))
        write_heatmap(reports, f"{out}.png")
        line += f"; report: {out}.json, {out}.png"
    print(line)
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    if not script.exists():
        raise UsageError(f"{script} not found; run it from a source checkout (pip install -e .) of "
                         "the zephon repository.")
    import runpy

    mod = runpy.run_path(str(script))
    return int(mod["main"](args.rest))


# --- the program -------------------------------------------------------------------------------------

class UsageError(Exception):
    """A mistake in how the command was called: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


VERIFY_HELP = """\
Runs a pipeline under a matrix of configurations and compares every global step, lane by lane
and row by row, with the reference: the numpy emitter at D=1. Exits 0 only when every
configuration is identical (1 when one differs or fails, 2 on a usage error), so it can gate CI.

TARGET is what to verify (several may be given; none: the three demo pipelines):
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
cannot take (D not dividing the lanes, ...) are listed as n/a with the reason.

Report: a table per pipeline, a summary line, and with --report PATH a JSON file and a PNG
heat map (configurations x steps; red where a step differs).

examples:
  zephon verify                                         # the demo pipelines (make verify)
  zephon verify my_project.data:pipeline --steps 50
  zephon verify examples/verify_pipeline.py:pipeline --backends numpy,torch --degrees 1,2,4
  zephon verify my_project.data:pipeline --resume 10:2->8,25:8->1 --processes 0
  zephon verify my_project.data:pipeline --only --config "numpy D=2 @10 -> jax mesh=2x4 micro=2"
  zephon verify plan.json --backends numpy --steps 100
"""

EXPLAIN_HELP = """\
Prints, for every row of global batch STEP, its lane and where its data came from: source,
record and epoch — or, for rows a packer built, every document piece (source, record, epoch,
token range).

TARGET is a plan's JSON (a file, the text, or a saved loader state; Grain-compatible plans
too): rows are resolved by the index algebra alone. Or MODULE:FACTORY / path/file.py:FACTORY
(as for `zephon verify`): the pipeline runs up to STEP (pipelines that filter or pack advance
by their data) and its batch is explained — packed rows included.

examples:
  zephon explain plan.json --step 3
  zephon explain examples/verify_pipeline.py:packed --step 5 --rows 0:2
  zephon explain my_project.data:pipeline --step 100 --world 8 --rank 3
"""


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    p = _Parser(prog="zephon", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traceback", action="store_true", help="on an error, print where it was raised")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)
    d = sub.add_parser("demo", help="prove elastic determinism on generated data (about a minute)",
                       description="Generates ArrayRecord and JSONL data in a temporary directory and "
                       "shows that the global batches are identical for D = 1, 2, 4, 8 ranks and across "
                       "a stop/resume at another D, for a shuffle, a filter and an LM pipeline "
                       "(tokenize, mix by tokens, pack).\n\nexample:\n  zephon demo --steps 30",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--records", type=int, default=20_000, help="records to generate (default 20000)")
    d.add_argument("--steps", type=int, default=60, help="global steps per configuration (default 60)")
    d.add_argument("--seed", type=int, default=2024, help="shuffle seed (default 2024)")
    d.set_defaults(fn=cmd_demo)
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
                        "(repeatable)")
    v.add_argument("--only", action="store_true", help="run only the --config configurations")
    v.add_argument("--report", default=None, metavar="PATH",
                   help="write PATH.json (every configuration's fingerprints and result) and PATH.png (heat map)")
    v.add_argument("--timeout", type=float, default=600.0, help="seconds for a multi-process run (default 600)")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.add_argument("--quiet", action="store_true", help="print the summary lines only")
    v.set_defaults(fn=cmd_verify)
    e = sub.add_parser("explain", help="which record (or which document pieces) sits at every row of a batch",
                       description=EXPLAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("target", metavar="TARGET", help="plan.json (or its text), MODULE:FACTORY or path/file.py:FACTORY")
    e.add_argument("--step", type=int, default=0, help="the global batch (default 0)")
    e.add_argument("--rows", default=None, metavar="A:B", help="rows to print (default: the first 16)")
    e.add_argument("--world", type=int, default=1, help="data-parallel degree, for a factory (default 1)")
    e.add_argument("--rank", type=int, default=0, help="the rank whose rows to print, for a factory (default 0)")
    e.set_defaults(fn=cmd_explain)
    b = sub.add_parser("bench", help="throughput against Grain and the raw ArrayRecord limit (~13 min)",
                       description="Runs benchmarks/run.py: Zephon, Grain's configurations and the raw "
                       "ArrayRecord/Parquet limits in one run; writes benchmarks/results/bench.{json,png}."
                       "\n\nexample:\n  zephon bench --quick", formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks/run.py (e.g. --quick)")
    b.set_defaults(fn=cmd_bench)
    args, extra = p.parse_known_args(argv)
    if extra and args.cmd != "bench":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "bench":
        args.rest = extra + args.rest
    if args.cmd == "verify" and "jax" not in sys.modules:  # 8 CPU devices for the mesh configurations
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from zephon.testing import FactoryError

    try:
        return int(args.fn(args))
    except (UsageError, FactoryError, ZephonError, FileNotFoundError, IsADirectoryError,
            PermissionError) as err:
        if args.traceback:
            raise
        msg = " ".join(str(err).split()) or type(err).__name__
        if isinstance(err, (FileNotFoundError, IsADirectoryError, PermissionError)) and err.filename:
            msg = f"{err.strerror}: {err.filename}"
        cause = err.__cause__
        hint = " (--traceback shows where)" if isinstance(err, FactoryError) and cause is not None else ""
        print(f"zephon {args.cmd}: error: {msg}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"zephon {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

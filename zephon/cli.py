"""`zephon demo | verify | explain | bench`: the command line.

The CLI is a user-facing program, so it prints; the library logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from zephon.checkpoint import load_state, save_state
from zephon.exec.loader import Loader, merge_states
from zephon.plan import Batch, Node, Source
from zephon.sources import ArrayRecordSource, FixedFields, write_sharded_array_record
from zephon.ops import Filter, Transform
from zephon.verify import first_mismatch, lane_digests, run_fingerprints, step_fingerprint

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


def _runner_run(plan: Batch, src: ArrayRecordSource, steps: int, spec: str) -> list[str]:
    """Fingerprints at D=2 with every rank's steps executed by a runner (speed only, never data)."""
    from zephon.runners import from_spec

    runners = [from_spec(spec) for _ in range(2)]
    loaders = [Loader(plan, src, rank=r, world=2, runner=runners[r]) for r in range(2)]
    try:
        return run_fingerprints(loaders, steps)
    finally:
        for l in loaders:
            l.close()


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


def cmd_explain(args: argparse.Namespace) -> int:
    text = Path(args.plan).read_text() if os.path.exists(args.plan) else args.plan
    plan = Node.from_json(json.loads(text))
    if not isinstance(plan, Batch):
        print("zephon explain: the plan's root must be a Batch (stream.lanes(L).batch(B))", file=sys.stderr)
        return 2
    print(plan.explain_text(args.step))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="zephon-verify-") as tmp:
        src = make_dataset(tmp, args.records)
        ok = True
        for mapping in ("contiguous", "interleaved"):
            plan = Source(len(src)).shuffle(args.seed).repeat().lanes(8, mapping).batch(64)
            extra = [(f"D=2, runner {spec}", lambda spec=spec, plan=plan: _runner_run(plan, src, args.steps, spec))
                     for spec in ("threads:2", "processes:2")]
            ok &= print_table(f"mapping={mapping}", matrix(plan, src, args.steps, (), tmp, extra))
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    if not script.exists():
        print(f"zephon bench: {script} not found; run it from a source checkout "
              "(pip install -e .) of the zephon repository.", file=sys.stderr)
        return 2
    import runpy

    mod = runpy.run_path(str(script))
    return int(mod["main"](args.rest))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="zephon", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="prove elastic determinism on generated ArrayRecord data")
    d.add_argument("--records", type=int, default=20_000)
    d.add_argument("--steps", type=int, default=60)
    d.add_argument("--seed", type=int, default=2024)
    d.set_defaults(fn=cmd_demo)
    v = sub.add_parser("verify", help="the configuration matrix: fingerprints must all agree")
    v.add_argument("--records", type=int, default=20_000)
    v.add_argument("--steps", type=int, default=200)
    v.add_argument("--seed", type=int, default=7)
    v.set_defaults(fn=cmd_verify)
    e = sub.add_parser("explain", help="which record sits at every row of a global batch")
    e.add_argument("plan", help="a plan's JSON, or a file holding it")
    e.add_argument("--step", type=int, default=0)
    e.set_defaults(fn=cmd_explain)
    b = sub.add_parser("bench", help="head-to-head throughput against Grain and the raw ArrayRecord limit")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks/run.py")
    b.set_defaults(fn=cmd_bench)
    args, extra = p.parse_known_args(argv)
    if extra and args.cmd != "bench":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "bench":
        args.rest = extra + args.rest
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())

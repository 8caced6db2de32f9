"""`zephon demo`: elastic determinism on generated data — ArrayRecord shards, a filter and the
LM pipeline (tokenize, mix by tokens, pack) at D = 1, 2, 4, 8 and across a stop/resume at another
D — and the generated data set the demo pipelines (`zephon.cli.pipelines`) read."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zephon.checkpoint import load_state, save_state
from zephon.exec.loader import Loader, merge_states
from zephon.fingerprints import first_mismatch, run_fingerprints
from zephon.ops import Filter, Operator
from zephon.pipeline import How, Pipeline, Where
from zephon.plan import Batching, Source
from zephon.sources import ArrayRecordSource, FixedFields, write_sharded_array_record

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


def _loaders(plan: Batching, src: Any, world: int, transforms: Sequence[Operator],
             **options: Any) -> list[Loader]:
    pipe = Pipeline(plan, src, tuple(transforms))
    return [Loader(pipe, Where(rank=r, world=world), How(**options)) for r in range(world)]


def resumed_run(plan: Batching, src: Any, steps: int, stop: int, world_before: int,
                world_after: int, transforms: Sequence[Operator], state_dir: str,
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


def matrix(plan: Batching, src: Any, steps: int, transforms: Sequence[Operator],
           state_dir: str, extra: Sequence[tuple[str, Callable[[], list[str]]]] = (),
           **options: Any) -> list[Run]:
    from tqdm import tqdm

    def at_degree(d: int) -> Callable[[], list[str]]:
        return lambda: run_fingerprints(_loaders(plan, src, d, transforms, **options), steps)

    jobs = [(f"D={d}", at_degree(d)) for d in (1, 2, 4, 8)]
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
        # a count-changing step: lanes carry cursors
        keep = Filter(lambda r: int(r["tokens"][0]) % 4 != 0, name="demo.keep_3_of_4")
        ok &= print_table("2) same plan + a filter (per-lane cursors carried in the state)",
                          matrix(plan, src, args.steps, (keep,), tmp))
        ok &= lm_demo(tmp, args.steps)
    print("\n" + ("PROVED: the same global batches for D = 1, 2, 4, 8 data-parallel ranks and across "
                  "stop/resume at a different D — also for online tokenization, token-weighted "
                  "mixing and packing." if ok else "FAILED: fingerprints differ (see above)."))
    return 0 if ok else 1


def lm_demo(tmp: str, steps: int) -> bool:
    """Two generated corpora (prose, code) as JSONL, a BPE trained here, mixed 70/30 by tokens
    inside every lane (30/70 from half-way: a curriculum), tokenized online and packed into rows
    of 256 tokens; and the pre-token cache's batches equal the tokenizer's own."""
    from zephon.demo.textdata import EOS_ID, generate_corpus, train_bpe, write_jsonl
    from zephon.ops.pack import Pack
    from zephon.ops.tokenize import Tokenize
    from zephon.plan import Mix
    from zephon.sources import JsonlSource

    prose, code = generate_corpus(400, seed=1), generate_corpus(300, seed=2, style="code")
    write_jsonl(Path(tmp) / "prose.jsonl", prose)
    write_jsonl(Path(tmp) / "code.jsonl", code)
    tok = train_bpe(prose[:200] + code[:150], vocab_size=2000)
    srcs = [JsonlSource(str(Path(tmp) / "prose.jsonl")), JsonlSource(str(Path(tmp) / "code.jsonl"))]
    change = max(1, steps // 2)
    plan = Mix([Source(len(prose), id=0, name="prose").shuffle(1).repeat(),
                Source(len(code), id=1, name="code").shuffle(2).repeat()], [0.7, 0.3],
               by="tokens", schedule=((change, (0.3, 0.7)),)).lanes(8).batch(16)
    ops = (Tokenize(tok, eos=EOS_ID), Pack(256, "concat"))
    first = next(Loader(Pipeline(plan, srcs, ops)))
    pad = float((first["segment_ids"] == 0).mean())
    assert first.segments is not None  # packed rows carry their document pieces
    print(f"\nLM pretraining: 2 JSONL corpora mixed 0.7/0.3 by tokens in every lane (0.3/0.7 from "
          f"step {change}), BPE tokenized online, packed to 16 x 256 (padding {pad:.1%}); row 0 "
          f"holds {len(first.segments[0])} document pieces, e.g. {first.explain()[0]['segments'][0]}")
    plain = (Tokenize(tok, eos=EOS_ID, cache=0), ops[1])  # the tokenizer's own encode_batch
    return print_table("3) tokenize + token-weighted mix with a curriculum + concat packing",
                       matrix(plan, srcs, steps, ops, tmp, extra=[(
                           "D=1, Tokenize pre-token cache off",
                           lambda: run_fingerprints([Loader(Pipeline(plan, srcs, plain))], steps))]))



def register(sub: Any) -> None:
    """Adds this command's parser to the `zephon` subcommands."""
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

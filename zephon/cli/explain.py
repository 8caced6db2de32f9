"""`zephon explain`: which record — or which document pieces, for packed rows — sits at every
row of a global batch, from a plan's JSON alone or by running a pipeline factory to the step."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from zephon.cli.usage import UsageError

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
  zephon explain my_project.data:pipeline --step 100000 --from-state ckpt/loader.json
  zephon explain plan.json --quality --rho 0.1      # how well the plan shuffles (zephon.plan.quality)
"""


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
    if args.quality:
        from zephon.plan.quality import shuffle_quality

        plan = load_plan(args.target) if _is_plan_target(args.target) else Builder(args.target)(1, 0).loader().plan
        q = shuffle_quality(plan, block=args.block, rho=args.rho)
        print(json.dumps(q.to_json(), indent=1) if args.json else q.text())
        return 0
    if _is_plan_target(args.target):
        plan = load_plan(args.target)
        from zephon.plan.blockshuffle import block_shuffles

        for node in block_shuffles(plan):  # the order's own numbers (block, window, stripes)
            print(node.explain_text())
        plan_rows = plan.explain(args.step)
        sel = _row_range(args.rows, len(plan_rows))
        print(f"{'row':>5} {'lane':>5} {'source':>6} {'record':>14} {'epoch':>6}")
        for j in sel:
            p = plan_rows[j]
            print(f"{p['row']:>5} {p['lane']:>5} {p['source']:>6} {p['record']:>14} {p['epoch']:>6}")
        if args.rows is None and len(plan_rows) > len(sel):
            print(f"... {len(plan_rows) - len(sel)} more rows (--rows A:B to choose)")
        return 0
    pipe = Builder(args.target)(args.world, args.rank)
    loader = pipe.loader(rank=args.rank, world=args.world)
    try:
        if args.from_state is not None:  # start from a saved state instead of step 0
            from zephon.checkpoint import load_state

            loader.restore(load_state(args.from_state))
            if loader.step > args.step:
                raise UsageError(f"--from-state {args.from_state} is at step {loader.step}, after "
                                 f"--step {args.step}; pass a state saved at or before it.")
        if loader.random_access:
            batch = loader.batch(args.step)
        else:  # lanes advance by the data: run up to the step (from the state's, with --from-state)
            from tqdm import tqdm

            for _ in tqdm(range(loader.step, args.step), desc=f"running to step {args.step}", unit="step",
                          leave=False, disable=args.step - loader.step < 50):
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



def register(sub: Any) -> None:
    """Adds this command's parser to the `zephon` subcommands."""
    e = sub.add_parser("explain", help="which record (or which document pieces) sits at every row of a batch",
                       description=EXPLAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("target", metavar="TARGET", help="plan.json (or its text), MODULE:FACTORY or path/file.py:FACTORY")
    e.add_argument("--step", type=int, default=0, help="the global batch (default 0)")
    e.add_argument("--rows", default=None, metavar="A:B", help="rows to print (default: the first 16)")
    e.add_argument("--world", type=int, default=1, help="data-parallel degree, for a factory (default 1)")
    e.add_argument("--rank", type=int, default=0, help="the rank whose rows to print, for a factory (default 0)")
    e.add_argument("--from-state", default=None, metavar="FILE",
                   help="a loader state saved at or before STEP (save_state; merged over ranks or this "
                        "rank's): a pipeline that filters or packs runs from there, not from step 0")
    e.add_argument("--quality", action="store_true",
                   help="print the shuffle-quality report instead: P(two rows of a batch share a block), "
                        "effective batch size, displacement / inversions against a full shuffle")
    e.add_argument("--block", type=int, default=None,
                   help="records per block for --quality (default: the plan's block shuffle's)")
    e.add_argument("--rho", type=float, default=0.1,
                   help="intra-block correlation for the effective batch size of --quality (default 0.1)")
    e.add_argument("--json", action="store_true", help="with --quality: the report as JSON")
    e.set_defaults(fn=cmd_explain)

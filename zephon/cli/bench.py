"""`zephon bench`: runs `benchmarks/run.py` of a source checkout (throughput against Grain and the
raw ArrayRecord/Parquet limits)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from zephon.cli.usage import UsageError


def cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"  # zephon/cli/bench.py
    if not script.exists():
        raise UsageError(f"{script} not found; run it from a source checkout (pip install -e .) of "
                         "the zephon repository.")
    import runpy

    mod = runpy.run_path(str(script))
    return int(mod["main"](args.rest))


def register(sub: Any) -> None:
    """Adds this command's parser to the `zephon` subcommands."""
    b = sub.add_parser("bench", help="throughput against Grain and the raw ArrayRecord limit (~13 min)",
                       description="Runs benchmarks/run.py: Zephon, Grain's configurations and the raw "
                       "ArrayRecord/Parquet limits in one run; writes benchmarks/results/bench.{json,png}."
                       "\n\nexample:\n  zephon bench --quick", formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks/run.py (e.g. --quick)")
    b.set_defaults(fn=cmd_bench)

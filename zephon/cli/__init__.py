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
  state     `state resign FILE`: re-sign a loader state edited by hand (its checksum)
  images    `images restart SHARD... --out DIR`: JPEG shards with restart markers, so a crop
            decodes only its own region (lossless)
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
import logging
import os
import sys
from collections.abc import Sequence

from zephon import __version__
from zephon.cli import bench, demo, explain, images, state, verify
from zephon.cli.demo import SPEC, make_dataset
from zephon.cli.pipelines import (
    DEMO_PIPELINES,
    demo_block_shuffle,
    demo_eval,
    demo_filter,
    demo_images,
    demo_images_skip,
    demo_lm,
    demo_shuffle,
)
from zephon.cli.usage import Parser, UsageError
from zephon.errors import ZephonError


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    p = Parser(prog="zephon", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traceback", action="store_true", help="on an error, print where it was raised")
    p.add_argument("--version", action="version", version=f"zephon {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=Parser)
    for command in (demo, verify, explain, state, images, bench):
        command.register(sub)
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


__all__ = ["DEMO_PIPELINES", "SPEC", "UsageError", "demo_block_shuffle", "demo_eval", "demo_filter", "demo_images",
           "demo_images_skip", "demo_lm", "demo_shuffle", "main", "make_dataset"]

"""`zephon images`: preparing image data for fast crops.

`zephon images restart SHARD... --out DIR` rewrites WebDataset tar shards with restart markers in
every JPEG (`zephon.media.restart_webdataset`): lossless (the DCT coefficients are copied, every
decoder gives the same pixels), and a crop of such a JPEG entropy-decodes only the rectangle of
restart intervals under it instead of every row above it (docs/images.md has the numbers).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

IMAGES_HELP = """\
restart SHARD... --out DIR   copy WebDataset tar shards to DIR with restart markers in every
                             .jpg/.jpeg member (lossless; other members unchanged), so that a
                             random-resized crop decodes only its own region of each JPEG

examples:
  zephon images restart data/train-*.tar --out data-rst/
  zephon images restart data/train-00000.tar --out data-rst/ --every-px 128
"""


def cmd_images(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from zephon.cli.usage import UsageError
    from zephon.media.libjpeg import available, restart_webdataset

    if not available():
        raise UsageError("zephon images restart needs zephon.media.libjpeg_binding (built at install with a C "
                         "compiler) and Pillow's libjpeg-turbo; reinstall zephon-loader with both")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [Path(s).name for s in args.shards]
    if len(set(names)) != len(names):
        raise UsageError("two shards have the same file name; they would overwrite each other in --out")
    total = 0
    for src in tqdm(args.shards, unit="shard", desc="restart markers"):
        if Path(src).resolve() == (out / Path(src).name).resolve():
            raise UsageError(f"--out {out} holds {src} itself; choose another directory")
        total += restart_webdataset(src, out / Path(src).name, args.every_px)
    print(f"{total} JPEGs in {len(args.shards)} shards rewritten with restart markers into {out}")
    return 0


def register(sub: Any) -> None:
    """Adds this command's parser to the `zephon` subcommands."""
    s = sub.add_parser("images", help="prepare image shards (restart markers for fast crops)",
                       description=IMAGES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("action", choices=["restart"], help="what to do (restart)")
    s.add_argument("shards", nargs="+", metavar="SHARD", help="WebDataset tar shards")
    s.add_argument("--out", required=True, help="directory for the rewritten shards (same file names)")
    s.add_argument("--every-px", type=int, default=64, help="restart interval width to aim for, pixels (64)")
    s.set_defaults(fn=cmd_images)

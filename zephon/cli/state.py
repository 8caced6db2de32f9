"""`zephon state`: what to do with a saved loader state file by hand.

`zephon state resign FILE` re-signs a state you edited on purpose: `load_state` refuses a file
whose checksum does not match (a flipped bit must never resume another stream), so a deliberate
edit needs this explicit step. It also upgrades a format-2 state (from before checksums).
"""

from __future__ import annotations

import argparse
from typing import Any

STATE_HELP = """\
resign FILE   re-sign a loader state you edited on purpose (load_state() verifies a checksum
              and refuses a changed file); also upgrades a format-2 state to format 3.
              Only for a file you checked yourself: Zephon then trusts what it says.

examples:
  zephon state resign ckpt/loader.json
"""


def cmd_state(args: argparse.Namespace) -> int:
    from zephon.checkpoint import resign_state

    state = resign_state(args.file)
    print(f"re-signed {args.file} (state format {state.get('zephon_state')}, step {state.get('step')})")
    return 0


def register(sub: Any) -> None:
    """Adds this command's parser to the `zephon` subcommands."""
    s = sub.add_parser("state", help="re-sign a loader state file edited by hand",
                       description=STATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("action", choices=["resign"], help="what to do (resign)")
    s.add_argument("file", metavar="FILE", help="the loader state file (JSON) save_state() wrote")
    s.set_defaults(fn=cmd_state)

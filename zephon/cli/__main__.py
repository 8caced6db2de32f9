"""`python -m zephon.cli`: the `zephon` program."""

import sys

from zephon.cli import main

sys.exit(main())

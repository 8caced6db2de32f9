"""`python -m zephon.testing worker ARGS`: the process side of multi-process runs (see `processes`)."""

import sys

from zephon.testing.processes import main

sys.exit(main())

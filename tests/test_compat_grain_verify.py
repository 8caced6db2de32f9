"""Real Grain as one more column of the verify matrix (`grain_fingerprints`).

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import grain
import numpy as np
from _grain import quiet_remainder_warning  # noqa: F401 - an autouse fixture

import zephon.compat.grain as zg
from zephon.fingerprints import run_fingerprints


def test_grain_is_one_more_column_of_the_verify_matrix() -> None:
    src = grain.sources.RangeDataSource(0, 500, 1)
    z = zg.Dataset.source(src).seed(9).shuffle().repeat().map(lambda x: {"t": np.arange(4) + x})
    z = z.lanes(8).batch(32)
    want = zg.grain_fingerprints(z.to_grain(), 6, lanes=8)
    for world in (1, 2, 4, 8):
        loaders = [z.loader(rank=r, world=world) for r in range(world)]
        assert run_fingerprints(loaders, 6) == want

"""Grain records <-> columns (`zephon.compat.grain.records`): Grain's batch structure kept.

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import grain
import numpy as np
from _grain import quiet_remainder_warning, same_all  # noqa: F401 - an autouse fixture

import zephon.compat.grain as zg


def test_dict_tuple_and_nested_records_keep_grains_structure() -> None:
    src = grain.sources.RangeDataSource(0, 40, 1)

    def rec(x):
        return {"a": np.full((2, 3), x, np.float32), "b": {"c": x, "d": (np.int8(x), f"s{x}")}}

    g = grain.MapDataset.source(src).shuffle(seed=4).map(rec).batch(8)
    z = zg.Dataset.source(src).shuffle(seed=4).map(rec).batch(8)
    gb, zb = next(iter(g)), next(iter(z))
    assert isinstance(zb["b"]["d"], tuple) and zb["a"].dtype == np.float32 and zb["a"].shape == (8, 2, 3)
    assert zb["b"]["d"][1].dtype == gb["b"]["d"][1].dtype == "<U3"  # Grain's str arrays
    assert np.array_equal(zb["b"]["d"][1], gb["b"]["d"][1])
    assert same_all(g, z) == 5
    gt = grain.MapDataset.source(src).shuffle(seed=4).map(lambda x: (x, np.float64(x) / 2)).batch(4)
    zt = zg.Dataset.source(src).shuffle(seed=4).map(lambda x: (x, np.float64(x) / 2)).batch(4)
    assert isinstance(next(iter(zt)), tuple) and same_all(gt, zt) == 10

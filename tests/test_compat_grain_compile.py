"""Compiling a Grain-shaped pipeline: unsupported steps fail naming the fix.

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import grain
import pytest
from _grain import quiet_remainder_warning  # noqa: F401 - an autouse fixture

import zephon.compat.grain as zg
from zephon.errors import DecodeError, PlanError


def test_unsupported_steps_fail_with_the_fix() -> None:
    src = grain.sources.RangeDataSource(0, 20, 1)
    ds = zg.Dataset.source(src)
    with pytest.raises(PlanError, match="requires a seed"):
        ds.shuffle()
    with pytest.raises(PlanError, match="requires a seed"):
        ds.random_map(lambda x, r: x)
    with pytest.raises(PlanError, match="steps after batch"):
        ds.batch(4).map(lambda x: x).loader()  # runs after the plan: iterate it instead
    with pytest.raises(PlanError, match="cannot follow to_iter_dataset"):
        ds.to_iter_dataset().shuffle(seed=1)
    with pytest.raises(PlanError, match="survived"):
        _ = ds.filter(bool).to_iter_dataset().random_map(lambda x, r: x, seed=1).batch(2).plan
    with pytest.raises(DecodeError, match="record 3 of source 0"):
        list(ds.map(lambda x: 1 // (x - 3)).batch(4))
    s = grain.samplers.IndexSampler(20, shuffle=True, seed=1, num_epochs=1)
    keep_all = type("KeepAll", (grain.transforms.Filter,), {"filter": lambda self, x: True})()
    with pytest.raises(PlanError, match="worker_count=0"):
        zg.DataLoader(data_source=src, sampler=s, worker_count=2, shard_options=grain.sharding.NoSharding(),
                      operations=[keep_all, grain.transforms.Batch(2)])

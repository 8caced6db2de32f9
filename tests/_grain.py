"""Helpers of the zephon.compat.grain tests: batch equality with real Grain, quiet logs."""

from __future__ import annotations

import logging

import grain
import numpy as np
import pytest

import zephon.compat.grain as zg


@pytest.fixture(autouse=True)
def quiet_remainder_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="zephon.compat.grain")


def same(grain_batch, zephon_batch) -> None:
    """Same structure, field names, dtypes, shapes and bytes (Grain's S/U arrays as exact objects)."""
    assert type(grain_batch) is type(zephon_batch) or (
        isinstance(grain_batch, np.ndarray) and isinstance(zephon_batch, np.ndarray))
    if isinstance(grain_batch, dict):
        assert sorted(grain_batch) == sorted(zephon_batch)
    a, b = zg.grain_batch_columns(grain_batch), zg.grain_batch_columns(zephon_batch)
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        assert np.array_equal(a[k], b[k]), k


def same_all(grain_batches, zephon_batches, *, full_only: bool = False) -> int:
    """Batch-for-batch equality, Grain's final partial batch included (iterating a Dataset emits
    it as Grain does); returns the number of batches. `full_only`: Zephon emits full batches
    only (zg.DataLoader), so Grain may have one more, smaller batch."""
    g, z = list(grain_batches), list(zephon_batches)
    assert len(z) > 0
    rows = lambda b: len(next(iter(zg.grain_batch_columns(b).values())))
    assert len(g) == len(z) or (full_only and len(g) == len(z) + 1 and rows(g[-1]) < rows(z[0]))
    for x, y in zip(g, z):
        same(x, y)
    return len(z)


class Jitter(grain.transforms.RandomMap):
    def random_map(self, x, rng):
        return {"x": x, "r": rng.integers(0, 1 << 30), "u": rng.random()}

"""Grain's record order (`zephon.compat.grain.order`, `.cipher`) against Grain's own functions and pipelines.

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest
from _grain import quiet_remainder_warning  # noqa: F401 - an autouse fixture
from grain._src.python.dataset.transformations.mix import _dataset_and_key_of_next_element
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module as grain_is

import zephon.compat.grain as zg
from zephon.plan import Node


@pytest.mark.parametrize("max_index", [1, 2, 9, 1000, 65535, 65536, 65537, 2 ** 20 + 3, 2 ** 32,
                                       10 ** 12 + 7, 2 ** 62, 2 ** 63 - 2])
def test_index_shuffle_equals_grains_binding(max_index: int) -> None:
    rng = np.random.default_rng(max_index % 1000)
    idx = np.unique(np.concatenate([rng.integers(0, max_index + 1, 300), [0, max_index]]))
    for seed in (0, 1, 52, 2 ** 32 - 1):
        want = [grain_is.index_shuffle(int(i), max_index, seed, 4) for i in idx]
        assert zg.index_shuffle(idx, max_index, seed).tolist() == want


def test_index_shuffle_is_a_bijection_with_per_index_seeds() -> None:
    n = 3000
    seeds = (7 + np.arange(2 * n) // n) % 2 ** 32  # two epochs in one call
    got = zg.index_shuffle(np.tile(np.arange(n), 2), n - 1, seeds)
    assert sorted(got[:n]) == list(range(n)) and sorted(got[n:]) == list(range(n))
    assert got.tolist() == [grain_is.index_shuffle(i % n, n - 1, int(s), 4)
                            for i, s in zip(range(2 * n), seeds)]


@pytest.mark.parametrize("props", [(1,), (1, 1), (100, 233), (100, 233, 7), (300, 100, 100)])
def test_mix_selection_equals_grain(props: tuple[int, ...]) -> None:
    k = np.concatenate([np.arange(500), [10 ** 9 + 3, 10 ** 15, 2 ** 62 + 11]])
    which, key = zg.mix_selection(k, props)
    want = [_dataset_and_key_of_next_element(int(i), props) for i in k]
    assert list(zip(which.tolist(), key.tolist())) == want


def test_grain_proportions_and_mix_length_follow_grain() -> None:
    assert zg.grain_proportions([0.3, 0.7], 2) == (100, 233)
    a, b = grain.sources.RangeDataSource(0, 50, 1), grain.sources.RangeDataSource(0, 77, 1)
    for w in (None, [0.3, 0.7], [5, 1]):
        g = grain.MapDataset.mix([grain.MapDataset.source(a), grain.MapDataset.source(b)], w)
        z = zg.Dataset.mix([zg.Dataset.source(a), zg.Dataset.source(b)], w)
        assert len(z) == len(g)


@pytest.mark.parametrize("n", [1, 2, 17, 1000, 4099])
@pytest.mark.parametrize("seed", [0, 1, 12345, 2 ** 32 - 1])
def test_shuffle_repeat_order_equals_grain(n: int, seed: int) -> None:
    src = grain.sources.RangeDataSource(0, n, 1)
    g = grain.MapDataset.source(src).shuffle(seed=seed).repeat(3)
    z = zg.Dataset.source(src).shuffle(seed=seed).repeat(3)
    refs = z.plan.lanes.resolve(np.arange(3 * n))  # records Zephon's plan names, all 3 epochs
    assert refs.record.tolist() == [g[i] for i in range(3 * n)]
    assert refs.epoch.tolist() == [i // n for i in range(3 * n)]


def test_shuffle_of_a_large_and_an_infinite_dataset_equals_grain() -> None:
    big = grain.sources.RangeDataSource(0, 10 ** 9 + 7, 1)
    g = grain.MapDataset.source(big).shuffle(seed=99).repeat()
    z = zg.Dataset.source(big).shuffle(seed=99).repeat()
    pos = np.random.default_rng(0).integers(0, 3 * (10 ** 9 + 7), 200)
    assert z.plan.lanes.resolve(pos).record.tolist() == [g[int(p)] for p in pos]
    # repeat first: Grain shuffles the whole sys.maxsize index space, and so does GrainShuffle
    small = grain.sources.RangeDataSource(0, 1000, 1)
    g = grain.MapDataset.source(small).repeat().shuffle(seed=5)
    z = zg.Dataset.source(small).repeat().shuffle(seed=5)
    pos = np.random.default_rng(1).integers(0, 2 ** 40, 100)
    assert z.plan.lanes.resolve(pos).record.tolist() == [g[int(p)] for p in pos]


def test_plans_with_grain_nodes_round_trip_through_json() -> None:
    a = grain.sources.RangeDataSource(0, 20, 1)
    z = zg.Dataset.mix([zg.Dataset.source(a).shuffle(seed=1), zg.Dataset.source(a).repeat()], [1, 2])
    plan = z.map_with_index(lambda i, x: x).lanes(2).batch(4).plan
    back = Node.from_json(json.dumps(plan.to_json()))
    assert back == plan and back.fingerprint() == plan.fingerprint()
    text = json.dumps(plan.to_json())
    assert all(f'"type": "{t}"' in text for t in ("GrainMix", "GrainShuffle", "GrainIndex", "ContiguousBatches"))

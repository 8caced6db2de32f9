"""Grain's transforms on Zephon (`zephon.compat.grain.transforms`): per-dataset chains, Grain's
index and generators, Zephon operators in between.

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import itertools

import grain
import numpy as np
from _grain import Jitter, quiet_remainder_warning, same_all  # noqa: F401 - an autouse fixture
from grain._src.python.dataset.transformations.map import RngPool

import zephon.compat.grain as zg


def test_mix_with_per_dataset_transforms_equals_grain() -> None:
    a, b = grain.sources.RangeDataSource(0, 50, 1), grain.sources.RangeDataSource(1000, 1077, 1)

    def pipeline(M):
        da = M.source(a).seed(3).shuffle().map(lambda x: {"x": x, "i": -1})
        db = M.source(b).shuffle(seed=9).repeat().map_with_index(lambda i, x: {"x": 2 * x, "i": i})
        mixed = M.mix([da, db], [0.3, 0.7]).random_map(lambda r, rng: (r["x"], r["i"], rng.normal()), seed=4)
        return mixed.batch(6)

    for lanes in (1, 3):
        assert same_all(pipeline(grain.MapDataset), pipeline(zg.Dataset).lanes(lanes)) == 28


def test_map_with_index_sees_grains_index_at_its_depth() -> None:
    src = grain.sources.RangeDataSource(0, 30, 1)

    def pipeline(M):
        return (M.source(src).map_with_index(lambda i, x: (i, x)).shuffle(seed=8).repeat(2)
                .map_with_index(lambda j, r: {"inner": r[0], "x": r[1], "outer": j}).batch(6))

    g = pipeline(grain.MapDataset)
    for lanes in (1, 2, 6):
        assert same_all(g, pipeline(zg.Dataset).lanes(lanes)) == 10
    out = list(pipeline(zg.Dataset))
    assert np.concatenate([b["outer"] for b in out]).tolist() == list(range(60))


def test_random_map_grain_order_draws_grains_numbers() -> None:
    src = grain.sources.RangeDataSource(0, 64, 1)
    g = grain.MapDataset.source(src).seed(42).shuffle().repeat(2).random_map(Jitter()).batch(8)
    z = zg.Dataset.source(src).seed(42).shuffle().repeat(2).random_map(Jitter()).batch(8)
    assert same_all(g, z.lanes(4)) == 16
    assert z.lanes(4).fingerprints(6, world=2) == zg.grain_fingerprints(g, 6, lanes=4)
    # after to_iter_dataset Grain counts elements; without a filter that is the position too
    gi = grain.MapDataset.source(src).shuffle(seed=1).to_iter_dataset().random_map(Jitter(), seed=3).batch(8)
    zi = zg.Dataset.source(src).shuffle(seed=1).to_iter_dataset().random_map(Jitter(), seed=3).batch(8)
    assert same_all(gi, zi) == 8
    pool = RngPool(3)
    want = [pool.acquire_rng(i).random() for i in (5, 0, 5)]
    assert [zg.grain_map_rng(3, i).random() for i in (5, 0, 5)] == want


def test_random_map_zephon_order_uses_the_records_own_generator() -> None:
    """In order='zephon' a record's draws depend on (seed, source, record, epoch) only."""
    src = grain.sources.RangeDataSource(0, 64, 1)

    def draws(shuffle_seed: int, lanes: int, world: int) -> dict[tuple[int, int], tuple[int, float]]:
        z = zg.Dataset.source(src, order="zephon").shuffle(seed=shuffle_seed).repeat(2)
        z = z.random_map(Jitter(), seed=7).lanes(lanes).batch(16)
        out = {}
        for r in range(world):
            for step, b in enumerate(itertools.islice(z.shard(r, world), 8)):
                for x, rr, u in zip(b["x"], b["r"], b["u"]):
                    out[(int(x), step * 16 // 64)] = (int(rr), float(u))
        return out

    a, b = draws(1, 4, 1), draws(2, 8, 4)
    assert a.keys() == b.keys() and len(a) == 128
    assert a == b  # another shuffle, lane count and degree: every (record, epoch) draws the same
    assert len(set(a.values())) == 128  # and the draws differ between (record, epoch)s
    g = grain.MapDataset.source(src).shuffle(seed=1).repeat(2).random_map(Jitter(), seed=7).batch(16)
    z = zg.Dataset.source(src, order="zephon").shuffle(seed=1).repeat(2).random_map(Jitter(), seed=7).batch(16)
    assert not np.array_equal(next(iter(g))["r"], next(iter(z))["r"])  # Grain's equal in distribution only


def test_zephon_row_operators_run_between_grain_maps():
    """map()/filter() take Zephon row operators too: Grain records are stacked into columns for
    them (a vectorised zephon.Map sees columns), and a Grain map after them sees dict records."""
    import zephon

    def plus_one(cols):
        return {"x": cols["x"] + 1}

    ds = (zg.Dataset.source([{"x": i} for i in range(64)]).map(lambda r: {"x": r["x"] * 2})
          .map(zephon.Map(plus_one, batched=True)).filter(zephon.Filter(lambda r: r["x"] % 3 != 0))
          .map(lambda r: {"y": int(r["x"]) * 10}).batch(4))
    it = iter(ds)
    want = [10 * (2 * i + 1) for i in range(64) if (2 * i + 1) % 3]
    got = np.concatenate([next(it)["y"] for _ in range(5)])
    assert got.tolist() == want[:20]
    assert [t.op_name for t in ds.transforms][1:3] == [
        "Map(test_zephon_row_operators_run_between_grain_maps.<locals>.plus_one)",
        "Filter(test_zephon_row_operators_run_between_grain_maps.<locals>.<lambda>)"]

"""zephon.compat.grain against real Grain on the same data.

Every equality here is checked against Grain itself (its compiled index_shuffle, its MapDataset
and DataLoader pipelines), never against numbers written down by hand — except the worker-order
golden lists, which were produced by real `grain.DataLoader(worker_count=2/3)` runs (Grain
0.2.18; the multiprocessing run takes ~45 s here, so the live comparison is marked slow).
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import json
import logging
import os

import grain
import numpy as np
import pytest
from absl import flags
from grain._src.python.dataset.transformations.map import RngPool
from grain._src.python.dataset.transformations.mix import _dataset_and_key_of_next_element
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module as grain_is

import zephon.compat.grain as zg
from zephon.errors import DecodeError, PlanError
from zephon.plan import Node
from zephon.sources import ArraySource, write_array_record
from zephon.verify import run_fingerprints

GRAIN_TESTDATA = os.path.join(os.path.dirname(grain.__file__), "_src", "python", "testdata")


@pytest.fixture(autouse=True)
def _quiet_remainder_warning(caplog: pytest.LogCaptureFixture) -> None:
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


def _rows(batch) -> int:
    return len(next(iter(zg.grain_batch_columns(batch).values())))


def same_all(grain_batches, zephon_batches) -> int:
    """Batch-for-batch equality; Grain may add one final partial batch, which Zephon never emits."""
    g, z = list(grain_batches), list(zephon_batches)
    assert len(z) > 0
    assert len(g) == len(z) or (len(g) == len(z) + 1 and _rows(g[-1]) < _rows(z[0]))
    for x, y in zip(g, z):
        same(x, y)
    return len(z)


# --- the order functions -----------------------------------------------------------------------

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


# --- MapDataset order ------------------------------------------------------------------------------

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


@pytest.mark.parametrize("lanes,world", [(1, 1), (2, 2), (4, 1), (4, 2), (8, 4)])
def test_batches_equal_grains_for_every_lane_count_and_rank(lanes: int, world: int) -> None:
    src = grain.sources.RangeDataSource(0, 301, 1)
    g = grain.MapDataset.source(src).seed(3).shuffle().repeat(2).map(lambda x: {"x": x, "y": [x, -x]}).batch(16)
    z = zg.Dataset.source(src).seed(3).shuffle().repeat(2).map(lambda x: {"x": x, "y": [x, -x]}).batch(16)
    z = z.lanes(lanes)
    assert same_all(g, z) == 602 // 16
    fps = zg.grain_fingerprints(g, 10, lanes=lanes)
    assert z.fingerprints(10, world=world) == fps
    # each rank iterates its own rows of Grain's global batch
    rank_batches = [zg.grain_batch_columns(next(iter(z.shard(r, world)))) for r in range(world)]
    whole = zg.grain_batch_columns(next(iter(g)))
    assert sorted(whole) == ["x", "y/0", "y/1"]
    for k in whole:
        assert np.array_equal(np.concatenate([b[k] for b in rank_batches]), whole[k])


def test_dict_tuple_and_nested_records_keep_grains_structure() -> None:
    src = grain.sources.RangeDataSource(0, 40, 1)

    def rec(x):
        return {"a": np.full((2, 3), x, np.float32), "b": {"c": x, "d": (np.int8(x), f"s{x}")}}

    g = grain.MapDataset.source(src).shuffle(seed=4).map(rec).batch(8)
    z = zg.Dataset.source(src).shuffle(seed=4).map(rec).batch(8)
    gb, zb = next(iter(g)), next(iter(z))
    assert isinstance(zb["b"]["d"], tuple) and zb["a"].dtype == np.float32 and zb["a"].shape == (8, 2, 3)
    assert zb["b"]["d"][1].dtype == object and list(zb["b"]["d"][1]) == list(gb["b"]["d"][1])
    assert same_all(g, z) == 5
    gt = grain.MapDataset.source(src).shuffle(seed=4).map(lambda x: (x, np.float64(x) / 2)).batch(4)
    zt = zg.Dataset.source(src).shuffle(seed=4).map(lambda x: (x, np.float64(x) / 2)).batch(4)
    assert isinstance(next(iter(zt)), tuple) and same_all(gt, zt) == 10


def test_mix_with_per_dataset_transforms_equals_grain() -> None:
    a, b = grain.sources.RangeDataSource(0, 50, 1), grain.sources.RangeDataSource(1000, 1077, 1)

    def pipeline(M):  # noqa: N803 - the Grain or the Zephon class
        da = M.source(a).seed(3).shuffle().map(lambda x: {"x": x, "i": -1})
        db = M.source(b).shuffle(seed=9).repeat().map_with_index(lambda i, x: {"x": 2 * x, "i": i})
        mixed = M.mix([da, db], [0.3, 0.7]).random_map(lambda r, rng: (r["x"], r["i"], rng.normal()), seed=4)
        return mixed.batch(6)

    for lanes in (1, 3):
        assert same_all(pipeline(grain.MapDataset), pipeline(zg.Dataset).lanes(lanes)) == 27


def test_slice_and_random_access_equal_grain() -> None:
    src = grain.sources.RangeDataSource(0, 50, 1)
    g = grain.MapDataset.source(src).shuffle(seed=1).repeat(4)[7:150:3].map(lambda x: x * 10)
    z = zg.Dataset.source(src).shuffle(seed=1).repeat(4)[7:150:3].map(lambda x: x * 10)
    assert len(z) == len(g) == 48
    assert [z[i] for i in range(len(z))] == [g[i] for i in range(len(g))] == list(z)
    assert z[-1] == g[47]
    gb, zb = g.batch(5), z.batch(5)
    assert len(zb) == 9 and np.array_equal(zb[3], gb[3])


def test_filter_then_iter_dataset_batches_equal_grain() -> None:
    src = grain.sources.RangeDataSource(0, 50, 1)
    keep = grain.transforms.Filter
    odd = type("NotOneMod4", (keep,), {"filter": lambda self, x: x % 4 != 1})()

    def pipeline(M):  # noqa: N803
        return M.source(src).shuffle(seed=1).repeat(3).filter(odd).to_iter_dataset().map(lambda x: x + 1).batch(5)

    g, z = pipeline(grain.MapDataset), pipeline(zg.Dataset)
    assert same_all(g, z) == 22
    gm = grain.MapDataset.source(src).shuffle(seed=1).filter(odd)
    zm = zg.Dataset.source(src).shuffle(seed=1).filter(odd)
    assert [zm[i] for i in range(50)] == [gm[i] for i in range(50)]  # None where filtered, as Grain
    assert list(zm) == list(gm)


def test_map_with_index_sees_grains_index_at_its_depth() -> None:
    src = grain.sources.RangeDataSource(0, 30, 1)

    def pipeline(M):  # noqa: N803
        return (M.source(src).map_with_index(lambda i, x: (i, x)).shuffle(seed=8).repeat(2)
                .map_with_index(lambda j, r: {"inner": r[0], "x": r[1], "outer": j}).batch(6))

    g = pipeline(grain.MapDataset)
    for lanes in (1, 2, 6):
        assert same_all(g, pipeline(zg.Dataset).lanes(lanes)) == 10
    out = list(pipeline(zg.Dataset))
    assert np.concatenate([b["outer"] for b in out]).tolist() == list(range(60))


class Jitter(grain.transforms.RandomMap):
    def random_map(self, x, rng):
        return {"x": x, "r": rng.integers(0, 1 << 30), "u": rng.random()}


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
    assert len({v for v in a.values()}) == 128  # and the draws differ between (record, epoch)s
    g = grain.MapDataset.source(src).shuffle(seed=1).repeat(2).random_map(Jitter(), seed=7).batch(16)
    z = zg.Dataset.source(src, order="zephon").shuffle(seed=1).repeat(2).random_map(Jitter(), seed=7).batch(16)
    assert not np.array_equal(next(iter(g))["r"], next(iter(z))["r"])  # Grain's equal in distribution only


# --- DataLoader + IndexSampler -------------------------------------------------------------------

@pytest.mark.parametrize("count,drop,shuffle,epochs,batch,sampler_sharded", [
    (1, False, True, 2, 4, True), (2, False, True, 2, 5, True), (3, True, True, 3, 4, True),
    (3, False, False, 2, 3, True), (2, False, True, None, 4, True), (4, False, True, 2, 3, False),
    (4, True, True, 1, 2, True)])
def test_dataloader_index_sampler_batches_equal_grain(count, drop, shuffle, epochs, batch,
                                                     sampler_sharded) -> None:
    src = grain.sources.RangeDataSource(0, 101, 1)
    ops = [grain.transforms.Batch(batch, drop_remainder=True)]
    globals_ = []
    for i in range(count):
        opts = grain.sharding.ShardOptions(i, count, drop)
        sampler = grain.samplers.IndexSampler(
            101, shard_options=opts if sampler_sharded else grain.sharding.NoSharding(),
            shuffle=shuffle, num_epochs=epochs, seed=11)
        gl = grain.DataLoader(data_source=src, sampler=sampler, operations=ops, shard_options=opts)
        zl = zg.DataLoader(data_source=src, sampler=sampler, operations=ops, shard_options=opts)
        assert same_all(itertools.islice(gl, 60), itertools.islice(zl, 60)) > 0
        globals_.append(zl)
    # Grain as a verify backend: the shards' batches concatenated are Zephon's global batches
    grain_global = zg.concat_shards([g.to_grain(i) for i, g in enumerate(globals_)])
    assert globals_[0].fingerprints(5) == zg.grain_fingerprints(grain_global, 5, lanes=count)


def test_dataloader_random_maps_share_graines_per_record_generator_through_a_filter() -> None:
    class Keep(grain.transforms.Filter):
        def filter(self, x):
            return x["x"] % 3 != 0

    class Again(grain.transforms.RandomMap):
        def random_map(self, x, rng):
            return {**x, "again": rng.random()}  # continues the generator Jitter drew from

    src = grain.sources.RangeDataSource(0, 50, 1)
    for i in range(2):
        opts = grain.sharding.ShardOptions(i, 2)
        s = grain.samplers.IndexSampler(50, shard_options=opts, shuffle=True, num_epochs=2, seed=9)
        ops = [Jitter(), Keep(), Again(), grain.transforms.Batch(4)]
        assert same_all(grain.DataLoader(data_source=src, sampler=s, operations=ops, shard_options=opts),
                        zg.DataLoader(data_source=src, sampler=s, operations=ops, shard_options=opts)) == 8


# Recorded from grain.DataLoader(RangeDataSource(0, 40, 1), IndexSampler(40, ShardOptions(1, 2),
# shuffle=False, num_epochs=1), [Batch(3, drop_remainder=True)], worker_count=W), Grain 0.2.18.
WORKER_ORDER = {
    2: [[20, 22, 24], [21, 23, 25], [26, 28, 30], [27, 29, 31], [32, 34, 36], [33, 35, 37]],
    3: [[20, 23, 26], [21, 24, 27], [22, 25, 28], [29, 32, 35], [30, 33, 36], [31, 34, 37]],
}


def _worker_loader(module, workers: int, **kw):
    opts = grain.sharding.ShardOptions(1, 2)
    s = grain.samplers.IndexSampler(40, shard_options=opts, shuffle=False, num_epochs=1, seed=3)
    return module.DataLoader(data_source=grain.sources.RangeDataSource(0, 40, 1), sampler=s,
                             operations=[grain.transforms.Batch(3, drop_remainder=True)],
                             worker_count=workers, shard_options=opts, **kw)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("lanes", [2, 6])
def test_dataloader_reproduces_grains_worker_order(workers: int, lanes: int) -> None:
    got = [b.tolist() for b in _worker_loader(zg, workers, lanes=lanes)]
    assert got == WORKER_ORDER[workers]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dataloader_worker_order_live_against_grain() -> None:
    flags.FLAGS.mark_as_parsed()
    for w in (2, 3):
        want = [b.tolist() for b in _worker_loader(grain, w)]
        assert want == WORKER_ORDER[w] == [b.tolist() for b in _worker_loader(zg, w)]


# --- sources -------------------------------------------------------------------------------------

def test_array_record_sources_grain_testdata_and_written(tmp_path) -> None:
    digits = grain.sources.ArrayRecordDataSource(
        sorted(glob.glob(os.path.join(GRAIN_TESTDATA, "digits.array_record-*"))))
    g = grain.MapDataset.source(digits).shuffle(seed=2).repeat(3).batch(4)
    z = zg.Dataset.source(digits).shuffle(seed=2).repeat(3).batch(4)
    assert same_all(g, z) == 7 and next(iter(z)).dtype == object
    assert z.fingerprints(7) == zg.grain_fingerprints(g, 7)

    path = str(tmp_path / "recs.array_record")
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, rng.integers(1, 40), dtype=np.uint8).tobytes() + b"\x01" for _ in range(300)]
    write_array_record(path, payloads)
    src = grain.sources.ArrayRecordDataSource([path])
    parse = lambda b: {"n": len(b), "head": np.frombuffer(b[:1], np.uint8)[0], "raw": b}  # noqa: E731
    g = grain.MapDataset.source(src).shuffle(seed=3).map(parse).batch(32)
    z = zg.Dataset.source(src).shuffle(seed=3).map(parse).lanes(4).batch(32)
    assert same_all(g, z) == 9
    assert z.fingerprints(9, world=2) == zg.grain_fingerprints(g, 9, lanes=4)


def test_user_source_uses_getitems_and_in_memory_source() -> None:
    class Squares:
        def __init__(self) -> None:
            self.bulk_calls = self.single_calls = 0

        def __len__(self) -> int:
            return 37

        def __getitem__(self, i):
            self.single_calls += 1
            return {"v": np.int64(i * i)}

        def __getitems__(self, keys):
            self.bulk_calls += 1
            return [{"v": np.int64(k * k)} for k in keys]

    sq = Squares()
    z = zg.Dataset.source(sq).shuffle(seed=6).repeat(2).batch(8)
    g = list(grain.MapDataset.source(sq).shuffle(seed=6).repeat(2).batch(8))
    sq.bulk_calls = sq.single_calls = 0
    assert same_all(g, z) == 9
    assert sq.bulk_calls >= 1 and sq.single_calls == 0  # Zephon reads through __getitems__ only
    mem = grain.sources.SharedMemoryDataSource([f"word{i}" for i in range(25)])
    try:
        gm = grain.MapDataset.source(mem).shuffle(seed=2).map(lambda w: {"w": w, "n": len(w)}).batch(5)
        zm = zg.Dataset.source(mem).shuffle(seed=2).map(lambda w: {"w": w, "n": len(w)}).batch(5)
        assert same_all(gm, zm) == 5
    finally:
        mem.close()
        mem.unlink()


def test_zephon_sources_work_in_the_grain_api() -> None:
    arr = ArraySource({"x": np.arange(40, dtype=np.int32), "y": np.arange(80.0).reshape(40, 2)})
    z = zg.Dataset.source(arr).shuffle(seed=1).batch(8)
    lst = [{"x": np.int32(i), "y": np.array([2.0 * i, 2.0 * i + 1])} for i in range(40)]
    same_all(grain.MapDataset.source(lst).shuffle(seed=1).batch(8), z)
    mixed = zg.Dataset.mix([zg.Dataset.source(arr), zg.Dataset.source(lst)]).map(lambda r: r["x"] * 2).batch(4)
    assert next(iter(mixed)).tolist() == [0, 0, 2, 2]


# --- state, checkpoints, plans -----------------------------------------------------------------

def not_mod3(x):
    return x % 3 != 0


def as_record(x):
    return {"x": x}


def plus_one(x):
    return x + 1


def test_get_state_set_state_round_trip_batched_and_unbatched() -> None:
    src = grain.sources.RangeDataSource(0, 97, 1)
    z = zg.Dataset.source(src).shuffle(seed=5).repeat().filter(not_mod3)  # state needs named functions
    z = z.map(as_record).batch(4)
    it = iter(z)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(6)]
    again = iter(z)
    again.set_state(state)
    for a, b in zip(want, [next(again) for _ in range(6)]):
        same(a, b)

    zu = zg.Dataset.source(src).shuffle(seed=5).repeat().lanes(4)
    gu = grain.MapDataset.source(src).shuffle(seed=5).repeat()
    it = iter(zu)
    head = [next(it) for _ in range(7)]  # mid-step: lanes=4 means 4 elements per step
    state = json.loads(json.dumps(it.get_state()))
    tail = [next(it) for _ in range(9)]
    resumed = iter(zu)
    resumed.set_state(state)
    assert [next(resumed) for _ in range(9)] == tail and head + tail == [gu[i] for i in range(16)]


def test_state_saved_at_one_degree_resumes_at_another() -> None:
    src = grain.sources.RangeDataSource(0, 200, 1)
    z = zg.Dataset.source(src).shuffle(seed=5).repeat().map(plus_one).lanes(4).batch(8)
    it = iter(z)
    for _ in range(3):
        next(it)
    state = it.get_state()
    whole = [next(it) for _ in range(2)]
    halves = []
    for r in range(2):
        part = iter(z.shard(r, 2))
        part.set_state(state)
        halves.append([next(part) for _ in range(2)])
    for k in range(2):
        assert np.array_equal(np.concatenate([halves[0][k], halves[1][k]]), whole[k])


@pytest.mark.skipif(importlib.util.find_spec("orbax") is None,
                    reason="orbax-checkpoint is not installed (pip install zephon[orbax])")
def test_orbax_checkpoint_through_grains_handler(tmp_path) -> None:
    import orbax.checkpoint as ocp

    src = grain.sources.RangeDataSource(0, 50, 1)
    z = zg.Dataset.source(src).seed(1).shuffle().repeat().random_map(Jitter()).batch(4)
    it = iter(z)
    for _ in range(3):
        next(it)
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as mngr:
        mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
        want = [next(it) for _ in range(4)]
        fresh = iter(z)
        mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    for a, b in zip(want, [next(fresh) for _ in range(4)]):
        same(a, b)
    saved = json.loads((tmp_path / "ckpt" / "3" / "data" / "process_0-of-1.json").read_text())
    assert saved["step"] == 3 and saved["plan_fingerprint"] == z.plan.fingerprint()  # the one state document


def test_plans_with_grain_nodes_round_trip_through_json() -> None:
    a = grain.sources.RangeDataSource(0, 20, 1)
    z = zg.Dataset.mix([zg.Dataset.source(a).shuffle(seed=1), zg.Dataset.source(a).repeat()], [1, 2])
    plan = z.map_with_index(lambda i, x: x).lanes(2).batch(4).plan
    back = Node.from_json(json.dumps(plan.to_json()))
    assert back == plan and back.fingerprint() == plan.fingerprint()
    text = json.dumps(plan.to_json())
    assert all(f'"type": "{t}"' in text for t in ("GrainMix", "GrainShuffle", "GrainIndex", "ContiguousBatches"))


def test_unsupported_steps_fail_with_the_fix() -> None:
    src = grain.sources.RangeDataSource(0, 20, 1)
    ds = zg.Dataset.source(src)
    with pytest.raises(PlanError, match="requires a seed"):
        ds.shuffle()
    with pytest.raises(PlanError, match="requires a seed"):
        ds.random_map(lambda x, r: x)
    with pytest.raises(PlanError, match="batch_fn"):
        ds.batch(4, batch_fn=list)
    with pytest.raises(PlanError, match="reseed_each_epoch"):
        ds.repeat(2, reseed_each_epoch=False)
    with pytest.raises(PlanError, match="after batch"):
        ds.batch(4).map(lambda x: x)
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


def test_backends_accept_a_grain_pipeline() -> None:
    jax = pytest.importorskip("jax")
    pytest.importorskip("zephon.backends.jax")
    src = grain.sources.RangeDataSource(0, 200, 1)
    rec = lambda x: {"x": np.int32(x), "y": np.full(3, x, np.float32)}  # noqa: E731
    z = zg.Dataset.source(src).shuffle(seed=3).repeat().map(rec).lanes(8).batch(16)
    g = iter(z.to_grain())
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with z.to_jax(mesh, "data") as jl:
        for _ in range(2):
            jb, gb = next(jl), next(g)
            assert all(np.array_equal(np.asarray(jb[k]), gb[k]) for k in gb)
    pytest.importorskip("zephon.backends.torch")
    tl = z.shard(1, 2).to_torch()
    first = next(iter(z.to_grain()))
    assert np.array_equal(next(iter(tl))["x"].numpy(), first["x"][8:])


def test_grain_is_one_more_column_of_the_verify_matrix() -> None:
    src = grain.sources.RangeDataSource(0, 500, 1)
    z = zg.Dataset.source(src).seed(9).shuffle().repeat().map(lambda x: {"t": np.arange(4) + x})
    z = z.lanes(8).batch(32)
    want = zg.grain_fingerprints(z.to_grain(), 6, lanes=8)
    for world in (1, 2, 4, 8):
        loaders = [z.loader(rank=r, world=world) for r in range(world)]
        assert run_fingerprints(loaders, 6) == want


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
    assert [t.op_name for t in ds.transforms][1:3] == ["Map(test_zephon_row_operators_run_between_grain_maps.<locals>.plus_one)",
                                                        "Filter(test_zephon_row_operators_run_between_grain_maps.<locals>.<lambda>)"]

"""Grain APIs the tutorials use, each compared exactly with real Grain (issue 27): steps after
batch, partial batches and len, past-the-end indexing, batch_fn, Grain's iterator datasets
(thread prefetch, device_put, IterDataset.mix, interleave, window shuffle, flat map, Parquet),
mp_prefetch, U/S strings, lambdas in checkpointed pipelines."""

from __future__ import annotations

import sys
import warnings

import grain
import numpy as np
import pytest
from _grain import quiet_remainder_warning, same  # noqa: F401 - an autouse fixture

import zephon.compat.grain as zg


def _eq(a, b) -> None:
    """Same Python/numpy structure and values (None where Grain has None)."""
    if a is None or b is None:
        assert a is b
    elif isinstance(a, (dict, tuple, list)) and not isinstance(a, np.ndarray):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a.values() if isinstance(a, dict) else a, b.values() if isinstance(b, dict) else b):
            _eq(x, y)
        if isinstance(a, dict):
            assert list(a) == list(b)
    else:
        x, y = np.asarray(a), np.asarray(b)
        assert (x.dtype, x.shape) == (y.dtype, y.shape) and np.array_equal(x, y)


def _both(build):
    return build(grain.MapDataset, grain.experimental), build(zg.Dataset, zg.experimental)


def test_steps_after_a_partial_batch_random_access_and_past_the_end() -> None:
    def build(M, _):
        return M.source(list(range(11))).shuffle(seed=10).map(lambda x: x + 1).batch(batch_size=2)

    g, z = _both(build)
    assert len(z) == len(g) == 6
    for i in (0, 5, 6, 8, 23):                     # 6.. : the next epochs, reshuffled
        _eq(g[i], z[i])
    _eq(list(g), list(z))
    gf, zf = g.filter(lambda e: e.sum() % 2 == 0), z.filter(lambda e: e.sum() % 2 == 0)
    _eq([gf[i] for i in range(len(gf))], [zf[i] for i in range(len(zf))])
    gs, zs = g[1::2].map(lambda b: b * 10), z[1::2].map(lambda b: b * 10)
    assert len(zs) == len(gs) == 3
    _eq(list(gs.to_iter_dataset()), list(zs.to_iter_dataset()))
    r = (lambda M, _: M.range(100).repeat().batch(8))
    assert len(r(zg.Dataset, 0)) == len(r(grain.MapDataset, 0)) == sys.maxsize // 8 + 1


def test_iter_batches_batch_fn_and_filters_after_batch() -> None:
    def build(M, _):
        ds = M.range(23).filter(lambda x: x % 3 != 0).to_iter_dataset()
        return ds.batch(4, batch_fn=lambda xs: {"sum": np.int64(sum(xs)), "n": len(xs)}).filter(
            lambda b: b["n"] > 0).map(lambda b: (b["sum"], b["n"]))

    g, z = _both(build)
    _eq(list(g), list(z))
    ragged = [{"tokens": np.arange(n)} for n in (2, 5, 3, 4, 2, 6, 3, 5)]

    def pad(items):
        m = max(len(x["tokens"]) for x in items)
        return np.stack([np.pad(x["tokens"], (0, m - len(x["tokens"]))) for x in items])

    gm = grain.MapDataset.source(ragged).batch(3, batch_fn=pad)
    zm = zg.Dataset.source(ragged).batch(3, batch_fn=pad)
    _eq([gm[i] for i in range(len(gm))], [zm[i] for i in range(len(zm))])


def test_thread_prefetch_and_device_put_equal_grain_and_resume() -> None:
    def build(M, X):
        ds = M.range(40).shuffle(seed=3).map(lambda x: {"x": np.int32(x)}).batch(4, drop_remainder=True)
        return X.ThreadPrefetchIterDataset(ds.to_iter_dataset(), prefetch_buffer_size=3).map(
            lambda b: {"x": b["x"] * 2})

    g, z = _both(build)
    _eq(list(g), list(z))
    it = iter(z)
    for _ in range(3):
        next(it)
    state = it.get_state()
    rest = list(it)
    it.set_state(state)
    _eq(list(it), rest)
    _eq(rest, list(g)[3:])
    jax = pytest.importorskip("jax")
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def put(M, X):
        ds = M.range(64).map(lambda x: {"x": np.float32(x)}).batch(16).to_iter_dataset()
        return X.device_put(ds=ds, device=sharding, cpu_buffer_size=2, device_buffer_size=2)

    gd, zd = _both(put)
    for a, b in zip(gd, zd, strict=True):
        assert b["x"].sharding == a["x"].sharding
        assert np.array_equal(np.asarray(a["x"]), np.asarray(b["x"]))


def test_iter_mix_interleave_window_shuffle_and_flat_map_equal_grain() -> None:
    def mix(M, _):
        a = M.range(30).filter(lambda x: x % 2 == 0).to_iter_dataset()
        b = M.range(100, 140).filter(lambda x: x % 5 != 0).to_iter_dataset()
        mixer = grain.IterDataset if M is grain.MapDataset else M  # zg.Dataset.mix dispatches
        return mixer.mix([a, b], weights=[0.7, 0.3]).map(lambda x: -x)

    g, z = _both(mix)
    _eq(list(g), list(z))
    gi = grain.IterDataset.mix([grain.MapDataset.range(5).to_iter_dataset(),
                                grain.MapDataset.range(10, 20).to_iter_dataset()])
    zi = zg.IterDataset.mix([zg.Dataset.range(5).to_iter_dataset(), zg.Dataset.range(10, 20).to_iter_dataset()])
    _eq(list(gi), list(zi))

    def interleave(M, X):
        parts = [M.range(10 * i, 10 * i + n).to_iter_dataset() for i, n in enumerate((3, 7, 1, 5, 4))]
        return X.InterleaveIterDataset(parts, cycle_length=2)

    g, z = _both(interleave)
    _eq(list(g), list(z))

    def window(M, X):
        return X.WindowShuffleIterDataset(M.range(37).to_iter_dataset(), window_size=8, seed=5)

    g, z = _both(window)
    _eq(list(g), list(z))
    it = iter(z)
    for _ in range(11):
        next(it)
    state, rest = it.get_state(), list(it)
    it.set_state(state)
    _eq(list(it), rest)

    class Repeat(grain.experimental.FlatMapTransform):
        max_fan_out = 3

        def flat_map(self, element):
            return [element * 10 + k for k in range(element % 3 + 1)]

    def flat(M, X):
        return X.FlatMapIterDataset(M.range(9).to_iter_dataset(), Repeat())

    g, z = _both(flat)
    _eq(list(g), list(z))


def test_parquet_iter_dataset_equals_grain(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    paths = []
    for f in range(2):
        t = pa.table({"s": [f"row{f}-{i}" for i in range(7)], "v": np.arange(7) + 100 * f})
        paths.append(str(tmp_path / f"p{f}.parquet"))
        pq.write_table(t, paths[-1], row_group_size=3)
    for p in (paths[0], paths):
        _eq(list(grain.experimental.ParquetIterDataset(p)), list(zg.experimental.ParquetIterDataset(p)))
    it = iter(zg.experimental.ParquetIterDataset(paths[0]))
    for _ in range(4):
        next(it)
    state, rest = it.get_state(), list(it)
    it.set_state(state)
    _eq(list(it), rest)


def test_string_batches_are_grains_u_and_s_arrays() -> None:
    def build(M, _):
        return M.range(10).map(lambda x: {"s": "ab" * (x % 3), "b": b"x" * x}).batch(5)

    g, z = _both(build)
    for a, b in zip(g, z, strict=True):
        assert (a["s"].dtype, a["b"].dtype) == (b["s"].dtype, b["b"].dtype)
        _eq(a, b)


def test_lambda_pipelines_checkpoint_with_one_warning_and_mp_prefetch_keeps_the_data() -> None:
    z = zg.Dataset.range(20).shuffle(seed=1).map(lambda x: x * 3).batch(4)
    it = iter(z)
    next(it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = it.get_state()
    msgs = [str(w.message) for w in caught if issubclass(w.category, zg.GrainCompatWarning)]
    assert len(msgs) <= 1 and all("lambda" in m and "not detected" in m for m in msgs)
    a = next(it)
    it.set_state(state)
    _eq(next(it), a)
    g = grain.MapDataset.range(20).shuffle(seed=1).map(lambda x: x * 3).batch(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _eq(list(g.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=0))),
            list(z.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2))))
        cfg = zg.experimental.pick_performance_config(ds=z, ram_budget_mb=1024, max_workers=2)
        assert cfg.multiprocessing_options.num_workers <= 2
        _eq(list(g), list(z.to_iter_dataset(read_options=cfg.read_options)))


def test_dataloader_partial_last_batch_and_batch_fn_equal_grain() -> None:
    class Keep(grain.transforms.Filter):
        def filter(self, x):
            return x % 4 != 1

    src = grain.sources.RangeDataSource(0, 23, 1)
    for ops in ([grain.transforms.Batch(5)], [Keep(), grain.transforms.Batch(4)],
                [grain.transforms.Batch(3, batch_fn=lambda xs: (sum(xs), len(xs)))]):
        s = grain.samplers.IndexSampler(23, shard_options=grain.sharding.NoSharding(), shuffle=True,
                                        num_epochs=2, seed=7)
        args = {"data_source": src, "sampler": s, "operations": ops, "worker_count": 0}
        _eq(list(grain.DataLoader(**args)), list(zg.DataLoader(**args)))


def test_flat_map_map_dataset_random_access_len_and_iteration_equal_grain() -> None:
    class Fan(grain.experimental.FlatMapTransform):
        max_fan_out = 3

        def flat_map(self, element):
            return [element * 10 + k for k in range(element % 3 + 1)]

    g = grain.experimental.FlatMapMapDataset(grain.MapDataset.range(7).shuffle(seed=2), Fan())
    z = zg.experimental.FlatMapMapDataset(zg.Dataset.range(7).shuffle(seed=2), Fan())
    assert len(z) == len(g) == 21
    _eq([g[i] for i in range(25)], [z[i] for i in range(25)])  # Nones in unused slots; next epoch
    _eq(list(g), list(z))
    _eq(list(g.to_iter_dataset().batch(4)), list(z.to_iter_dataset().batch(4)))


def test_repeat_without_reseed_and_to_iter_dataset_with_nones_equal_grain() -> None:
    def build(M, _):
        return M.range(9).shuffle(seed=4).random_map(lambda x, r: x + r.integers(100), seed=1).repeat(
            3, reseed_each_epoch=False)

    g, z = _both(build)
    assert len(z) == len(g) == 27
    _eq([g[i] for i in range(30)], [z[i] for i in range(30)])
    _eq(list(g), list(z))
    gn = grain.MapDataset.range(10).filter(lambda x: x % 3 == 0).to_iter_dataset(allow_nones=True)
    zn = zg.Dataset.range(10).filter(lambda x: x % 3 == 0).to_iter_dataset(allow_nones=True)
    _eq(list(gn), list(zn))

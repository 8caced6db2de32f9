"""`zg.DataLoader` + IndexSampler against `grain.DataLoader`.

The worker-order golden lists were produced by real `grain.DataLoader(worker_count=2/3)` runs (Grain
0.2.18; the multiprocessing run takes ~45 s here, so the live comparison is marked slow).

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import itertools

import grain
import pytest
from _grain import Jitter, quiet_remainder_warning, same_all  # noqa: F401 - an autouse fixture
from absl import flags

import zephon
import zephon.compat.grain as zg
from zephon.exec.steps import READ_AHEAD_ROWS
from zephon.runners import threads


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
                        zg.DataLoader(data_source=src, sampler=s, operations=ops, shard_options=opts),
                        full_only=True) == 8


class NotMod3(grain.transforms.Filter):
    def filter(self, x):
        return x % 3 != 0


def _filtering_loader(**kw):
    opts = grain.sharding.ShardOptions(0, 1)
    s = grain.samplers.IndexSampler(60, shard_options=opts, shuffle=True, num_epochs=1, seed=4)
    return zg.DataLoader(data_source=grain.sources.RangeDataSource(0, 60, 1), sampler=s,
                         operations=[NotMod3(), grain.transforms.Batch(4, drop_remainder=True)],
                         shard_options=opts, **kw)


def test_dataloader_extras_are_where_and_how_and_the_old_keywords_warn_for_one_version() -> None:
    """Zephon's extras of the Grain DataLoader are `where=`/`how=`; the old `rank=`, `world=`,
    `runner=`, `read_ahead=` give the same batches with a DeprecationWarning naming the new form;
    `How(read_ahead=None)` is the loader's one default, an explicit value wins."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns about nothing
        new = _worker_loader(zg, 0, where=zephon.Where(rank=1, world=2), how=zephon.How(runner=threads(2),
                                                                                        read_ahead=9))
        want = [b.tolist() for b in new]
    with pytest.warns(DeprecationWarning, match=r"DataLoader\(rank=\.\.\., world=\.\.\., runner=\.\.\., "
                                                 r"read_ahead=\.\.\.\) is deprecated and will be removed in the next "
                                                 r"version; use zephon\.compat\.grain\.DataLoader\("
                                                 r"where=zephon\.Where\(rank=\.\.\., world=\.\.\.\), "
                                                 r"how=zephon\.How\(runner=\.\.\., "
                                                 r"read_ahead=\.\.\.\)\)"):
        old = _worker_loader(zg, 0, rank=1, world=2, runner=threads(2), read_ahead=9)
    assert [b.tolist() for b in old] == want == [b.tolist() for b in _worker_loader(zg, 0)] != []
    assert new.where.rank_world() == old.where.rank_world() == (1, 2)  # the shard's, by default
    assert _worker_loader(zg, 0).where.rank_world() == (1, 2)
    assert new.loader().read_ahead == 9
    assert _worker_loader(zg, 0).loader().read_ahead == READ_AHEAD_ROWS  # the core's, the one default
    with pytest.warns(DeprecationWarning, match="READ_AHEAD is deprecated"):
        assert zg.READ_AHEAD == READ_AHEAD_ROWS
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['mesh_dims'\]"):
        _worker_loader(zg, 0, mesh_dims=("data",))
    with pytest.raises(TypeError, match="not both"):
        _worker_loader(zg, 0, rank=1, where=zephon.Where(rank=1))
    # its pipeline is one zephon.Pipeline; a filtering chain is collated by CollatingLoader, a thin
    # layer over one zephon.Loader
    dl = _filtering_loader()
    assert isinstance(dl.pipeline, zephon.Pipeline) and dl.pipeline.loader_cls is zg.CollatingLoader
    assert dl.pipeline.describe()["plan_fingerprint"] == dl.plan.fingerprint()
    assert zg.RECORD in next(dl.pipeline.replace(loader_cls=None).loader()).data  # a Loader alone: records
    cl = dl.loader()
    assert isinstance(cl, zg.CollatingLoader) and isinstance(cl.loader, zephon.Loader)
    first = next(cl)
    assert sorted(first.data) == [zg.VALUE] and first.data[zg.VALUE].dtype.kind == "i"  # columns, not records
    assert len(first.data[zg.VALUE]) == 4 and all(v % 3 for v in first.data[zg.VALUE])
    state = cl.state()
    second = next(cl)
    again = dl.loader()
    again.restore(state)
    assert again.step == cl.step - 1 and next(again).data[zg.VALUE].tolist() == second.data[zg.VALUE].tolist()


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

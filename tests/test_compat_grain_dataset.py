"""The `Dataset` facade: Grain's batches for every lane count and rank, slicing, random access, filters, backends.

Every equality is checked against Grain itself, never against numbers written down by hand."""

from __future__ import annotations

import grain
import numpy as np
import pytest
from _grain import quiet_remainder_warning, same_all  # noqa: F401 - an autouse fixture

import zephon.compat.grain as zg


@pytest.mark.parametrize("lanes,world", [(1, 1), (2, 2), (4, 1), (4, 2), (8, 4)])
def test_batches_equal_grains_for_every_lane_count_and_rank(lanes: int, world: int) -> None:
    src = grain.sources.RangeDataSource(0, 301, 1)
    g = grain.MapDataset.source(src).seed(3).shuffle().repeat(2).map(lambda x: {"x": x, "y": [x, -x]}).batch(16)
    z = zg.Dataset.source(src).seed(3).shuffle().repeat(2).map(lambda x: {"x": x, "y": [x, -x]}).batch(16)
    z = z.lanes(lanes)
    assert same_all(g, z) == -(-602 // 16)  # with Grain's partial last batch
    fps = zg.grain_fingerprints(g, 10, lanes=lanes)
    assert z.fingerprints(10, world=world) == fps
    # each rank iterates its own rows of Grain's global batch
    rank_batches = [zg.grain_batch_columns(next(iter(z.shard(r, world)))) for r in range(world)]
    whole = zg.grain_batch_columns(next(iter(g)))
    assert sorted(whole) == ["x", "y/0", "y/1"]
    for k in whole:
        assert np.array_equal(np.concatenate([b[k] for b in rank_batches]), whole[k])


def test_slice_and_random_access_equal_grain() -> None:
    src = grain.sources.RangeDataSource(0, 50, 1)
    g = grain.MapDataset.source(src).shuffle(seed=1).repeat(4)[7:150:3].map(lambda x: x * 10)
    z = zg.Dataset.source(src).shuffle(seed=1).repeat(4)[7:150:3].map(lambda x: x * 10)
    assert len(z) == len(g) == 48
    assert [z[i] for i in range(len(z))] == [g[i] for i in range(len(g))] == list(z)
    assert z[-1] == g[47]
    gb, zb = g.batch(5), z.batch(5)
    assert len(zb) == len(gb) == 10 and np.array_equal(zb[3], gb[3])
    assert np.array_equal(zb[9], gb[9]) and np.array_equal(zb[12], gb[12])  # partial; next epoch


def test_filter_then_iter_dataset_batches_equal_grain() -> None:
    src = grain.sources.RangeDataSource(0, 50, 1)
    keep = grain.transforms.Filter
    odd = type("NotOneMod4", (keep,), {"filter": lambda self, x: x % 4 != 1})()

    def pipeline(M):
        return M.source(src).shuffle(seed=1).repeat(3).filter(odd).to_iter_dataset().map(lambda x: x + 1).batch(5)

    g, z = pipeline(grain.MapDataset), pipeline(zg.Dataset)
    assert same_all(g, z) == 23
    gm = grain.MapDataset.source(src).shuffle(seed=1).filter(odd)
    zm = zg.Dataset.source(src).shuffle(seed=1).filter(odd)
    assert [zm[i] for i in range(50)] == [gm[i] for i in range(50)]  # None where filtered, as Grain
    assert list(zm) == list(gm)


def test_backends_accept_a_grain_pipeline() -> None:
    jax = pytest.importorskip("jax")
    pytest.importorskip("zephon.backends.jax")
    src = grain.sources.RangeDataSource(0, 200, 1)
    rec = lambda x: {"x": np.int32(x), "y": np.full(3, x, np.float32)}
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


def twice(x):
    return {"x": x * 2}


def test_a_dataset_is_one_zephon_pipeline_and_its_loader_takes_where_and_how() -> None:
    """`Dataset.pipeline()` is the dataset's `zephon.Pipeline` (what `explain`/`verify` print);
    `loader(where, how)` runs it — the dataset's `shard()`/`runner()`/`read_ahead()` by default —
    and the old `loader(rank=, world=)` gives the same batches with a DeprecationWarning."""
    import warnings

    import zephon
    from zephon.exec.steps import READ_AHEAD_ROWS
    from zephon.runners import threads

    src = grain.sources.RangeDataSource(0, 200, 1)
    ds = zg.Dataset.source(src).shuffle(seed=2).repeat().map(twice).batch(16).lanes(4)
    pipe = ds.pipeline()
    assert isinstance(pipe, zephon.Pipeline) and pipe.dataset is ds and pipe.loader_cls is zg.CollatingLoader
    assert pipe.plan is ds.plan and pipe.describe()["plan_fingerprint"] == ds.plan.fingerprint()
    assert [o["name"] for o in pipe.describe()["ops"]] == ["grain.Map(twice)", "grain.Collate"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns about nothing
        new = ds.loader(zephon.Where(rank=1, world=2), zephon.How(runner=threads(2), read_ahead=32))
        want = [next(new).data["x"].tolist() for _ in range(3)]
        assert new.read_ahead == 32 and new.rank == 1
        sharded = ds.shard(1, 2).read_ahead(32).loader()  # the dataset's own knobs are the defaults
        assert [next(sharded).data["x"].tolist() for _ in range(3)] == want
        assert sharded.read_ahead == 32 and ds.loader().read_ahead == READ_AHEAD_ROWS  # the core's default
    with pytest.warns(DeprecationWarning, match=r"Dataset\.loader\(rank=\.\.\., world=\.\.\.\) is deprecated and "
                                                 r"will be removed in the next version; use Dataset\.loader\("
                                                 r"zephon\.Where\(rank=\.\.\., world=\.\.\.\)\)"):
        old = ds.loader(rank=1, world=2)
    assert [next(old).data["x"].tolist() for _ in range(3)] == want
    g = grain.MapDataset.source(src).shuffle(seed=2).repeat().map(twice).batch(16)
    halves = [b["x"][8:].tolist() for b in [g[0], g[1], g[2]]]  # rank 1 of 2: the second half
    assert want == halves
    with pytest.raises(zephon.PlanError, match=r"pipeline\(\) needs the pipeline to end in the plan's global batch"):
        zg.Dataset.source(src).batch(4).map(twice).pipeline()


def test_explain_names_a_grain_datasets_pipeline_fingerprint(tmp_path, capsys) -> None:
    """`zephon explain` of a factory returning a Grain `Dataset` prints the fingerprint of its
    `zephon.Pipeline` — the same value `Dataset.pipeline().fingerprint()` gives."""
    from zephon.cli import main

    f = tmp_path / "grain_factory.py"
    f.write_text("import grain\nimport zephon.compat.grain as zg\n\n\ndef pipeline():\n"
                 "    src = grain.sources.RangeDataSource(0, 100, 1)\n"
                 "    return zg.Dataset.source(src).shuffle(seed=1).repeat().batch(8).lanes(4)\n")
    assert main(["explain", f"{f}:pipeline", "--step", "2", "--rows", "0:2"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    src = grain.sources.RangeDataSource(0, 100, 1)
    want = zg.Dataset.source(src).shuffle(seed=1).repeat().batch(8).lanes(4).pipeline()
    assert header.endswith(f"plan {want.plan.fingerprint()}, pipeline {want.fingerprint()}")

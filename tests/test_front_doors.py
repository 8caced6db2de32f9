"""The front doors take `(pipeline, where=, how=)`; the old forms still work, warn, and give the
same batches; every emitter's batch reads like a mapping (`batch["field"]`, `dict(batch)`)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import zephon as z
from zephon.errors import PlanError
from zephon.ops import Filter
from zephon.sources import ArraySource

N = 96


def keep_odd(cols):
    return cols["x"] % 2 == 1


def source() -> ArraySource:
    return ArraySource({"x": np.arange(N, dtype=np.int32), "y": np.arange(N, dtype=np.float32) * 2})


def pipeline(ops=()) -> z.Pipeline:
    return z.Pipeline(z.Source(N).shuffle(seed=3).repeat().lanes(8).batch(16), source(), ops, seed=1)


def take(loader, n: int = 3) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(v) for k, v in dict(next(loader)).items()} for _ in range(n)]


def same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def old_form(call):
    """Runs `call()`, which must warn once that its form is deprecated, from this file's line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning)
           and "is deprecated and will be removed in the next version" in str(w.message)]
    assert len(dep) == 1, [str(w.message) for w in caught]
    # attributed to the caller (here), so pyproject's error filter for zephon modules catches
    # a library module that still calls the old form, and no test that calls it on purpose
    assert dep[0].filename == __file__, dep[0].filename
    return out, str(dep[0].message)


def check_mapping(batch, fields=("x", "y")) -> None:
    """`batch` reads like a dict of its fields."""
    assert sorted(batch.keys()) == sorted(fields)
    assert sorted(batch) == sorted(fields)  # iterating gives the field names
    assert "x" in batch and "nope" not in batch
    assert batch.get("nope") is None and batch.get("nope", 7) == 7
    as_dict = dict(batch)
    assert sorted(as_dict) == sorted(fields)
    for k, v in batch.items():
        assert as_dict[k] is v and batch[k] is v
    assert len(list(batch.values())) == len(fields)
    with pytest.raises(KeyError, match="nope"):
        batch["nope"]


# --- numpy ------------------------------------------------------------------------------------
def test_numpy_local_batch_is_subscriptable() -> None:
    loader = z.Loader(pipeline(), z.Where(rank=1, world=2))
    batch = next(loader)
    check_mapping(batch)
    np.testing.assert_array_equal(batch["x"], batch.data["x"])
    assert batch["x"].shape == (8,)
    assert batch  # no len(): a batch stays truthy (a field count is not a row count)
    assert [m["x"].tolist() for m in batch.micro_batches(2)] == [batch["x"][:4].tolist(), batch["x"][4:].tolist()]


# --- JAX ----------------------------------------------------------------------------------------
jax = pytest.importorskip("jax")


def test_jax_new_form_equals_old_form_and_batches_are_mappings() -> None:
    from zephon.backends.jax import JaxLoader

    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    pipe = pipeline([Filter(keep_odd, batched=True)])
    with JaxLoader(pipe, z.Where(mesh=mesh), z.How(prefetch=1, telemetry=False)) as new:
        got = take(new)
        new.restore(new.state())
        check_mapping(next(new))
    old, msg = old_form(lambda: JaxLoader(pipe.plan, pipe.sources, pipe.ops, seed=1, mesh=mesh, prefetch=1,
                                          telemetry=False))
    with old:
        same(take(old), got)
    assert "JaxLoader(zephon.Pipeline(plan, sources, ops, seed=...), where=zephon.Where(mesh=...), " \
           "how=zephon.How(telemetry=..., prefetch=...))" in msg, msg
    same(got, take(z.Loader(pipe)))  # one process: the whole global batch, as numpy's


def test_jax_refuses_what_the_mesh_decides() -> None:
    from zephon.backends.jax import JaxLoader

    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    with pytest.raises(PlanError, match=r"Where\(rank=..., world=...\).*derived from the mesh"):
        JaxLoader(pipeline(), z.Where(rank=0, world=1))
    with pytest.raises(PlanError, match="either mesh="):
        JaxLoader(pipeline(), z.Where())
    with pytest.raises(TypeError, match="prefetch goes in zephon.How"):
        JaxLoader(pipeline(), z.Where(mesh=mesh), prefetch=2)
    with pytest.raises(PlanError, match=r"JaxLoader\(how=...\) takes a zephon.How, got Where"):
        JaxLoader(pipeline(), z.Where(mesh=mesh), z.Where())


# --- torch --------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def test_torch_loader_new_form_equals_old_form_and_batches_are_mappings() -> None:
    from zephon.backends.torch import TorchLoader

    pipe = pipeline([Filter(keep_odd, batched=True)])
    new = TorchLoader(pipe, z.Where(rank=1, world=2), z.How(read_ahead=64), dtypes={"y": torch.float64})
    got = take(new)
    assert new.where.rank == 1 and new.loader.where.world == 2 and new.how.read_ahead == 64
    old, msg = old_form(lambda: TorchLoader(pipe.plan, pipe.sources, pipe.ops, seed=1, rank=1, world=2,
                                            read_ahead=64, dtypes={"y": torch.float64}))
    same(take(old), got)
    assert "where=zephon.Where(rank=..., world=...), how=zephon.How(read_ahead=...)" in msg, msg
    batch = next(new)
    check_mapping(batch)
    assert batch["y"].dtype == torch.float64
    same(got, take(z.Loader(pipe, z.Where(rank=1, world=2))))


def test_torch_old_mesh_dims_is_batch_axes() -> None:
    from zephon.backends.torch import TorchLoader

    _, msg = old_form(lambda: TorchLoader(pipeline().plan, source(), rank=0, world=1, mesh_dims=None))
    assert "batch_axes=..." in msg and "mesh_dims" not in msg, msg
    with pytest.raises(TypeError, match="batch_axes goes in zephon.Where"):
        TorchLoader(pipeline(), mesh_dims=("dp",))
    with pytest.raises(PlanError, match=r"TorchLoader got Where\(sharding=...\)"):
        TorchLoader(pipeline(), z.Where(sharding=object()))
    with pytest.raises(PlanError, match="batch axes split a mesh"):
        TorchLoader(pipeline(), z.Where(rank=0, world=1, batch_axes="dp"))


def test_dataset_and_dataloader_new_form_equals_old_form() -> None:
    from zephon.backends.torch import ZephonDataLoader, ZephonIterableDataset

    pipe = pipeline()
    ds = ZephonIterableDataset(pipe, z.Where(rank=0, world=2), z.How(telemetry=False), start_step=1)
    dl = ZephonDataLoader(ds, num_workers=0)
    got = take(iter(dl))
    old, msg = old_form(lambda: ZephonIterableDataset(pipe.plan, pipe.sources, seed=1, rank=0, world=2,
                                                      start_step=1, telemetry=False))
    same(take(iter(ZephonDataLoader(old))), got)
    assert "how=zephon.How(telemetry=...)" in msg, msg
    check_mapping(next(iter(dl)))
    with pytest.raises(PlanError, match="telemetry"):
        dl.stats()  # How(telemetry=False) reaches the DataLoader
    same(got, take(z.Loader(pipe, z.Where(rank=0, world=2), start_step=1)))
    with pytest.raises(PlanError, match=r"Where\(mesh=...\).*use TorchLoader"):
        ZephonIterableDataset(pipe, z.Where(mesh=object()))


def test_dataloader_telemetry_moved_into_the_dataset_how() -> None:
    from zephon.backends.torch import ZephonDataLoader, ZephonIterableDataset

    tel = z.Telemetry()
    dl = ZephonDataLoader(ZephonIterableDataset(pipeline(), how=z.How(telemetry=tel)))
    next(iter(dl))
    assert dl.stats().steps == 1 and dl._tel is tel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dl = ZephonDataLoader(ZephonIterableDataset(pipeline()), telemetry=False)
    assert any("ZephonDataLoader(dataset, telemetry=...) is deprecated" in str(w.message) and
               "How(telemetry=...)" in str(w.message) for w in caught)
    with pytest.raises(PlanError, match="telemetry"):
        dl.stats()


# --- Grain-compatible ------------------------------------------------------------------------------
# what this checks is the batch's shape; whether zephon.compat.grain builds its loader in the new
# form is pyproject's error filter's business in the compat tests
@pytest.mark.filterwarnings("ignore:.* is deprecated and will be removed in the next version:DeprecationWarning")
def test_grain_compatible_batches_are_mappings() -> None:
    pytest.importorskip("grain")
    import zephon.compat.grain as zg

    def as_record(i):
        return {"x": np.int32(i), "y": np.float32(2 * i)}

    it = iter(zg.Dataset.source(list(range(N))).shuffle(seed=5).repeat().map(as_record).batch(8))
    check_mapping(next(it))

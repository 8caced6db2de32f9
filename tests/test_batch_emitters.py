"""Every emitter follows a batch-size schedule and resumes at another global batch size:
sharded JAX (arrays re-shaped per step), torch loaders and DataLoader workers, the Grain API."""

import json

import numpy as np
import pytest

from zephon import Filter, Loader, PlanError, Source, StateError
from zephon.backends import numpy as npb
from zephon.sources.memory import ArraySource

N = 499
RAMP = ((0, 8), (2, 16), (4, 32))
TIMEOUT = 60


def source():
    ids = np.arange(N, dtype=np.int64)
    return ArraySource({"id": ids, "x": (ids[:, None] * 3 + np.arange(4)).astype(np.int32)})


def keep(cols):
    return cols["id"] % 4 != 1


def plan(schedule=RAMP, size=None):
    return Source(N).shuffle(5).repeat().lanes(8).batch(size, schedule=None if size else schedule)


def reference(p, steps, transforms=(), state=None):
    l = Loader(p, source(), list(transforms))
    if state is not None:
        l.restore(state, allow_batch_change=True)
    return [npb.emit(next(l)) for _ in range(steps)]


def saved_after(p, steps, transforms=()):
    l = Loader(p, source(), list(transforms))
    for _ in range(steps):
        next(l)
    return json.loads(json.dumps(l.state()))


def test_jax_arrays_are_reshaped_per_step_and_resume_at_another_size():
    jax = pytest.importorskip("jax")
    from zephon.backends.jax import JaxLoader

    mesh = jax.make_mesh((8,), ("data",))
    ref = reference(plan(), 6)
    with JaxLoader(plan(), source(), mesh=mesh, micro_batches=1) as jl:
        got = [next(jl) for _ in range(6)]
        state = jl.state()
    assert [g["id"].shape for g in got] == [(8,), (8,), (16,), (16,), (32,), (32,)]
    for g, want in zip(got, ref):
        assert np.array_equal(np.asarray(g["x"]), want["x"])
        assert len(g["id"].sharding.device_set) == 8
    # a resume on a "smaller cluster": B=16 from step 6, lanes continue where they stopped
    q = plan(size=16)
    with JaxLoader(q, source(), mesh=mesh) as jl:
        with pytest.raises(StateError, match="allow_batch_change"):
            jl.restore(state)
        jl.restore(state, allow_batch_change=True)
        after = [next(jl) for _ in range(3)]
    want = reference(q, 3, state=state)
    assert all(np.array_equal(np.asarray(a["id"]), w["id"]) for a, w in zip(after, want))
    assert {a["id"].shape for a in after} == {(16,)}
    # micro-batches split every device's rows at every size: 8 rows over 8 devices cannot be 2
    with pytest.raises(PlanError, match=r"8-row batches from step 0 \(8 blocks"):
        JaxLoader(plan(), source(), mesh=mesh, micro_batches=2)
    with pytest.raises(PlanError, match=r"batch size 12 \(from step 2\) is not divisible by the 8 batch shards"):
        JaxLoader(Source(N).lanes(4).batch(schedule=((0, 8), (2, 12))), source(), mesh=mesh)


def test_torch_loader_follows_the_schedule_and_resumes_at_another_size():
    pytest.importorskip("torch")
    from zephon.backends import torch as tb

    ref = reference(plan(), 5, [Filter(keep)])
    tl = tb.TorchLoader(plan(), source(), [Filter(keep)])
    got = [next(tl) for _ in range(5)]
    assert [len(g["id"]) for g in got] == [8, 8, 16, 16, 32]
    assert all(np.array_equal(g["id"].numpy(), w["id"]) for g, w in zip(got, ref))
    state = tl.state_dict()
    q = plan(size=24)
    resumed = tb.TorchLoader(q, source(), [Filter(keep)])
    with pytest.raises(StateError, match="allow_batch_change"):
        resumed.load_state_dict(state)
    resumed.load_state_dict(state, allow_batch_change=True)
    want = reference(q, 4, [Filter(keep)], state=state)
    assert all(np.array_equal(next(resumed)["id"].numpy(), w["id"]) for w in want)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("transforms", [(), (Filter(keep),)], ids=["by-step", "by-lanes"])
def test_dataloader_workers_follow_the_schedule_and_resume_at_another_size(transforms):
    pytest.importorskip("torch")
    from zephon.backends import torch as tb

    state = saved_after(plan(), 3, transforms)
    q = plan(schedule=((0, 8), (5, 16), (7, 40)))
    want = reference(q, 6, transforms, state=state)
    dl = tb.ZephonDataLoader(tb.ZephonIterableDataset(q, source(), list(transforms)), num_workers=2,
                             timeout=TIMEOUT)
    dl.load_state_dict(state, allow_batch_change=True)
    got = []
    for batch in dl:
        got.append(batch)
        if len(got) == 6:
            break
    assert [len(g["id"]) for g in got] == [8, 8, 16, 16, 40, 40]
    assert all(np.array_equal(g["id"].numpy(), w["id"]) for g, w in zip(got, want))
    # the DataLoader's state continues the same lanes under the new plan
    again = reference(q, 2, transforms, state=dl.state_dict())
    more = next(iter(dl))
    assert np.array_equal(more["id"].numpy(), again[0]["id"])


def test_dataset_len_follows_a_resume_at_another_size():
    pytest.importorskip("torch")
    from zephon.backends import torch as tb

    p = Source(N).shuffle(5).lanes(8).batch(schedule=RAMP)
    ds = tb.ZephonIterableDataset(p, source())
    assert len(ds) == p.num_steps == 2 + 2 + (N // 8 - 6) // 4
    ds.restore(saved_after(p, 3), allow_batch_change=True)  # lanes at input 4 of 62
    q = Source(N).shuffle(5).lanes(8).batch(16)
    ds2 = tb.ZephonIterableDataset(q, source())
    ds2.restore(saved_after(p, 3), allow_batch_change=True)
    assert len(ds2) == (N // 8 - 4) // 2 == len(list(ds2))


def test_grain_api_batch_schedule_and_set_state_at_another_size():
    grain = pytest.importorskip("grain")
    import zephon.compat.grain as zg

    src = grain.sources.RangeDataSource(0, 400, 1)
    ds = zg.Dataset.source(src, order="zephon").seed(3).shuffle().repeat().lanes(8)
    it = iter(ds.batch(schedule=RAMP))
    got = [next(it) for _ in range(5)]
    assert [len(g) for g in got] == [8, 8, 16, 16, 32]
    state = it.get_state()
    it2 = iter(ds.batch(64))
    with pytest.raises(StateError, match="allow_batch_change"):
        it2.set_state(state)
    it2.set_state(state, allow_batch_change=True)
    rest = np.concatenate([next(it2) for _ in range(3)])
    seen = np.concatenate(got)
    # one epoch of 400 is 50 inputs a lane: 10 + 3 * 8 = 34 of them so far, all distinct records
    assert len(rest) == 192 and len(np.unique(np.concatenate([seen, rest]))) == len(seen) + 192
    with pytest.raises(PlanError, match="no Grain order"):
        iter(zg.Dataset.source(src).seed(3).shuffle().lanes(8).batch(schedule=RAMP))

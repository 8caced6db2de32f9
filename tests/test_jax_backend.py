"""The JAX backend emits the numpy reference's global batches, bit for bit, on any mesh."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import _jax_mp_worker as mp_worker  # tests/ is on sys.path (rootdir conftest, no __init__.py)
import jax
import numpy as np
import pytest
from _helpers import run_group
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zephon import Filter, Loader, Map, PlanError, Source, merge_states
from zephon.backends.jax import JaxLoader, batch_sharding, plan_layout, process_ranks
from zephon.backends.numpy import emit
from zephon.fingerprints import global_fingerprint, step_fingerprint
from zephon.sources.memory import ArraySource

N = 1000


def make_source(n: int = N) -> ArraySource:
    return ArraySource({"x": np.arange(n * 6, dtype=np.float32).reshape(n, 3, 2),
                        "label": (np.arange(n, dtype=np.int32) * 7) % 13,
                        "id": np.arange(n, dtype=np.int32)})


def make_plan(lanes: int = 8, batch: int = 32, mapping: str = "contiguous"):
    return Source(N).shuffle(3).repeat().lanes(lanes, mapping).batch(batch)


def make_mesh(shape: tuple[int, ...]) -> Mesh:
    names = ("data", "fsdp") if len(shape) == 2 else ("data",)
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def reference(plan, source, transforms=(), steps: int = 4) -> list[dict[str, np.ndarray]]:
    loader = Loader(plan, source, transforms)
    return [emit(next(loader)) for _ in range(steps)]


def assert_same(arrays: dict[str, jax.Array], ref: dict[str, np.ndarray], spec: P) -> None:
    assert set(arrays) == set(ref)
    for name, want in ref.items():
        got = arrays[name]
        assert got.sharding.spec == spec, name
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


@pytest.mark.parametrize("shape,axes", [
    ((8,), "data"), ((4, 2), "data"), ((4, 2), ("data", "fsdp")),
    ((2, 4), "data"), ((2, 4), ("data", "fsdp")), ((2, 4), ("fsdp", "data")),
])
def test_global_arrays_equal_numpy_reference(shape, axes):
    plan, source = make_plan(), make_source()
    mesh = make_mesh(shape)
    with JaxLoader(plan, source, mesh=mesh, batch_axes=axes) as loader:
        got = [next(loader) for _ in range(4)]
    shards = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
    for arrays, ref in zip(got, reference(plan, source)):
        assert_same(arrays, ref, P(axes))
        assert {s.data.shape[0] for s in arrays["x"].addressable_shards} == {plan.size // shards}
    assert loader.layout.world == 1


def test_sharding_passed_directly_per_field():
    """Fields with extra dims can be split over a second mesh axis; the batch dim stays the same."""
    mesh = make_mesh((4, 2))
    shardings = {"x": NamedSharding(mesh, P("data", None, "fsdp")), "label": NamedSharding(mesh, P("data")),
                 "id": NamedSharding(mesh, P("data"))}
    plan, source = make_plan(), make_source()
    with JaxLoader(plan, source, sharding=shardings, prefetch=0) as loader:
        arrays = next(loader)
    ref = reference(plan, source, steps=1)[0]
    for name, want in ref.items():
        assert arrays[name].sharding.spec == shardings[name].spec
        np.testing.assert_array_equal(np.asarray(arrays[name]), want)
    assert {s.data.shape for s in arrays["x"].addressable_shards} == {(8, 3, 1)}
    with pytest.raises(PlanError, match="split the batch dim the same way"):
        JaxLoader(plan, source, sharding={"x": NamedSharding(mesh, P("data")), "id": NamedSharding(mesh, P("fsdp"))})


@pytest.mark.parametrize("shape,axes,procs,world", [
    ((8,), "data", 2, 2), ((8,), "data", 4, 4), ((8,), "data", 8, 8),
    ((2, 4), ("data", "fsdp"), 4, 4),
    ((4, 2), "data", 2, 2),
    ((2, 4), "data", 4, 2),  # two processes per mesh row hold the same rows: replicas share a rank
])
def test_data_parallel_degree_changes_no_array(shape, axes, procs, world):
    """Plays `procs` hosts over the 8 devices: each loads only its rank's rows; arrays don't change."""
    plan, source = make_plan(), make_source()
    mesh = make_mesh(shape)
    sharding = batch_sharding(mesh, axes)
    flat = list(mesh.devices.flat)
    process_of = lambda d: flat.index(d) * procs // len(flat)
    layouts = {p: plan_layout(plan, sharding, p, process_of) for p in range(procs)}
    assert {dp.world for dp in layouts.values()} == {world}
    assert process_ranks(sharding, process_of) == layouts
    loaders = {dp.rank: Loader(plan, source, rank=dp.rank, world=dp.world) for dp in layouts.values()}
    for ref in reference(plan, source, steps=3):
        local = {r: next(l) for r, l in loaders.items()}
        for name, want in ref.items():
            shards = []
            for device, index in sharding.devices_indices_map(want.shape).items():
                dp = layouts[process_of(device)]
                first = dp.rank * plan.size // dp.world
                start, stop, _ = index[0].indices(plan.size)
                shards.append(jax.device_put(local[dp.rank].data[name][start - first:stop - first], device))
            got = jax.make_array_from_single_device_arrays(want.shape, sharding, shards)
            np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_restore_mid_run_equals_uninterrupted_on_another_mesh(prefetch):
    # a count-changing step: per-lane cursors in the state
    transforms = (Filter(lambda c: c["label"] % 4 != 1, batched=True, name="label_mod4_not_1"),)
    plan, source = make_plan(), make_source()
    ref = reference(plan, source, transforms, steps=7)
    with JaxLoader(plan, source, transforms, mesh=make_mesh((2, 4)), batch_axes=("data", "fsdp"),
                   prefetch=prefetch) as first:
        for i in range(3):
            assert_same(next(first), ref[i], P(("data", "fsdp")))
        saved = json.loads(json.dumps(first.get_state()))
        assert saved["step"] == first.step == 3  # consumed, whatever was prefetched
        assert_same(next(first), ref[3], P(("data", "fsdp")))
    with JaxLoader(plan, source, transforms, mesh=make_mesh((8,)), prefetch=prefetch) as resumed:
        resumed.set_state(saved)
        for i in range(3, 7):
            assert_same(next(resumed), ref[i], P("data"))
        resumed.restore(saved)  # rewinds past prefetched batches
        assert_same(next(resumed), ref[3], P("data"))


def test_bad_mesh_and_batch_combinations():
    source = make_source()
    with pytest.raises(PlanError, match=r"batch size 36 is not divisible by the 8 batch shards.*'data'=8"):
        JaxLoader(make_plan(lanes=4, batch=36), source, mesh=make_mesh((8,)))
    with pytest.raises(PlanError, match=r"batch size 12 .* 8 batch shards .*'data'=2, 'fsdp'=4"):
        JaxLoader(make_plan(lanes=4, batch=12), source, mesh=make_mesh((2, 4)), batch_axes=("data", "fsdp"))
    with pytest.raises(PlanError, match=r"batch axes \['model'\] are not axes of the mesh"):
        JaxLoader(make_plan(), source, mesh=make_mesh((8,)), batch_axes="model")
    with pytest.raises(PlanError, match="either mesh= .* or sharding="):
        JaxLoader(make_plan(), source)
    sharding = batch_sharding(make_mesh((8,)), "data")
    hosts = lambda d: d.id // 2
    with pytest.raises(PlanError, match=r"lanes=6 cannot be split over the 4 processes .* lanes=12"):
        plan_layout(make_plan(lanes=6, batch=48), sharding, 0, hosts)
    with pytest.raises(PlanError, match="mapping 'interleaved'.*contiguous block"):
        plan_layout(make_plan(mapping="interleaved"), sharding, 1, hosts)
    with pytest.raises(PlanError, match=r"process 0 holds batch shards \[0, 2, 4, 6\].*not one contiguous"):
        plan_layout(make_plan(), sharding, 0, lambda d: d.id % 2)
    with pytest.raises(PlanError, match="process 5 has no device"):
        plan_layout(make_plan(), sharding, 5, hosts)


def test_unrepresentable_fields_raise_in_the_consumer():
    text = ArraySource({"id": np.arange(N, dtype=np.int32),
                        "text": np.array([b"r%d" % i for i in range(N)], dtype=object)})
    with (JaxLoader(make_plan(), text, mesh=make_mesh((8,))) as loader,
          pytest.raises(PlanError, match=r"field 'text' has dtype object .* exclude=\('text',\)")):
        next(loader)
    with JaxLoader(make_plan(), text, mesh=make_mesh((8,)), exclude=("text",)) as loader:
        assert set(next(loader)) == {"id"}
    big = ArraySource({"h": np.arange(N, dtype=np.int64) << 40})
    with (JaxLoader(make_plan(), big, mesh=make_mesh((8,)), prefetch=0) as loader,
          pytest.raises(PlanError, match="do not fit int32.*jax_enable_x64")):
        next(loader)


def test_prefetch_errors_surface_and_close_stops_the_thread():
    plan = Source(N).lanes(8).batch(32)  # unshuffled: batch k holds records 32k .. 32k+31

    def explode(cols):
        if cols["id"].max() >= 64:
            raise ValueError("record 64 is corrupt")
        return cols

    with JaxLoader(plan, make_source(), (Map(explode, batched=True, name="explode"),), mesh=make_mesh((8,)),
                   prefetch=3) as loader:
        assert [int(np.asarray(next(loader)["id"]).max()) for _ in range(2)] == [31, 63]
        for _ in range(2):  # raised again, never a hang
            with pytest.raises(ValueError, match="record 64 is corrupt"):
                next(loader)
        assert loader.state()["step"] == 2
    threads = lambda: [t for t in threading.enumerate() if t.name == "zephon-jax-prefetch"]
    before = len(threads())
    loader = JaxLoader(make_plan(), make_source(), mesh=make_mesh((8,)), prefetch=2)
    next(loader)
    assert len(threads()) == before + 1
    loader.close()
    assert len(threads()) == before
    with pytest.raises(StopIteration):
        next(loader)
    abandoned = JaxLoader(make_plan(), make_source(), mesh=make_mesh((8,)), prefetch=2)
    next(abandoned)
    del abandoned  # no close(): collecting the loader stops its thread
    gc.collect()
    assert len(threads()) == before


def test_state_counts_consumed_batches_not_prefetched():
    plan = Source(N).lanes(8).batch(32)  # unshuffled: batch k holds records 32k .. 32k+31
    reached_step_5 = threading.Event()

    def watch(cols):
        if cols["id"].max() >= 5 * 32:
            reached_step_5.set()
        return cols

    transforms = (Map(watch, batched=True, name="watch"),)
    with JaxLoader(plan, make_source(), transforms, mesh=make_mesh((8,)), prefetch=2) as loader:
        for _ in range(3):
            next(loader)
        assert reached_step_5.wait(timeout=30), "the prefetch thread never ran ahead"
        state = loader.state()
        assert state["step"] == loader.step == 3
        assert int(np.asarray(next(loader)["id"]).min()) == 3 * 32
    with JaxLoader(plan, make_source(), transforms, mesh=make_mesh((8,))) as resumed:
        resumed.restore(state)
        assert int(np.asarray(next(resumed)["id"]).min()) == 3 * 32


def test_finite_plan_stops():
    plan = Source(64).lanes(8).batch(32)
    with JaxLoader(plan, make_source(64), mesh=make_mesh((8,))) as loader:
        assert len(list(loader)) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_equal_single_process(tmp_path: Path):
    steps = 6
    plan, source, transforms = mp_worker.pipeline()
    with JaxLoader(plan, source, transforms, mesh=make_mesh((2, 4)), batch_axes=("data", "fsdp")) as single:
        want = [global_fingerprint({k: np.asarray(v) for k, v in next(single).items()}, plan.lanes.count)
                for _ in range(steps)]
        single_state = single.state()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    worker = Path(__file__).with_name("_jax_mp_worker.py")
    port, procs = _free_port(), []
    outs, logs = [tmp_path / f"p{i}.json" for i in range(2)], [tmp_path / f"p{i}.log" for i in range(2)]
    try:
        for i in range(2):
            with open(logs[i], "wb") as log:  # a file, not a pipe: a chatty worker cannot block
                procs.append(subprocess.Popen(
                    [sys.executable, str(worker), "--process-id", str(i), "--port", str(port),
                     "--steps", str(steps), "--out", str(outs[i])],
                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for p, log in zip(procs, logs):
            assert p.wait(timeout=120) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        for p in procs:  # each in its own process group: end the group, forked children too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    results = [json.loads(o.read_text()) for o in outs]
    assert [(r["rank"], r["world"], r["local_devices"], r["global_devices"]) for r in results] == \
        [(0, 2, 4, 8), (1, 2, 4, 8)]
    got = [step_fingerprint({int(l): d for r in results for l, d in r["digests"][str(s)].items()})
           for s in range(steps)]
    assert got == want
    assert merge_states([r["state"] for r in results]) == single_state



def test_training_example_runs_with_prefetch_and_equal_loss_curves():
    """The README's JAX example: jit SGD on meshes (8,) and (2,4), prefetch 2, resume mid-run.

    Regression: transfers dispatched from the prefetch thread during the step's cross-device
    all-reduce made XLA's CPU rendezvous abort ("Expected 8 threads to join").
    """
    script = Path(__file__).resolve().parent.parent / "examples" / "jax_train.py"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = run_group([sys.executable, str(script), "--steps", "100"], env=env, timeout=180,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "max |loss(8,) - loss(2,4)| over 100 steps: 0\n" in done.stdout
    assert "vs uninterrupted over steps 50..99: 0\n" in done.stdout

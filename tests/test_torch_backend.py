"""PyTorch backend: tensors equal the numpy reference bit for bit, zero-copy, DDP over gloo,
DataLoader workers, StatefulDataLoader-style state through torch.save and torch.distributed.checkpoint."""

import contextlib
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import _torch_ddp_worker as ddp_worker  # tests/ is on sys.path under pytest's rootdir conftest
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader

from zephon import Filter, Loader, PlanError, Source, StateError, load_state, merge_states, save_state
from zephon.backends import numpy as npb
from zephon.backends import torch as tb
from zephon.fingerprints import lane_digests, step_fingerprint
from zephon.ops.pack import Pack
from zephon.runners import processes, threads
from zephon.sources.memory import ArraySource

N = 203  # prime: batches straddle epochs


def make_source(n: int = N) -> ArraySource:
    ids = np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(0)
    return ArraySource({
        "tokens": (ids[:, None] * 7 + np.arange(8)).astype(np.int32),
        "id": ids,
        "x": rng.standard_normal((n, 3)).astype(np.float32),
        "u8": (ids % 251).astype(np.uint8),
        "flag": ids % 2 == 0,
        "half": rng.standard_normal(n).astype(np.float16),
    })


#: the fields of make_source that are one value per record, not per token: packing leaves them out
PER_RECORD = ("id", "x", "u8", "flag", "half")


def plan(seed: int = 3, lanes: int = 8, batch: int = 32):
    return Source(N).shuffle(seed).repeat().lanes(lanes).batch(batch)


def finite_plan():
    return Source(N).shuffle(4).lanes(8).batch(8)  # 25 steps: not a multiple of 2 or 3 workers


def numpy_ref(p, steps: int, transforms=(), start: int = 0) -> list[dict[str, np.ndarray]]:
    loader = Loader(p, make_source(), transforms, start_step=start)
    return [npb.emit(next(loader)) for _ in range(steps)]


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        t = got[k]
        assert isinstance(t, torch.Tensor), k
        arr = t.numpy()
        assert arr.dtype == v.dtype and arr.shape == v.shape, k
        assert arr.tobytes() == v.tobytes(), k  # bit for bit


def keep(record: dict) -> bool:
    return int(record["id"]) % 4 != 1


# --- emitting -----------------------------------------------------------------------------------
def test_tensors_equal_numpy_reference_and_share_its_memory():
    loader = Loader(plan(), make_source())
    ref = numpy_ref(plan(), 4)
    for want in ref:
        batch = next(loader)
        got = tb.emit(batch)
        assert_same(got, want)
        assert {str(t.dtype) for t in got.values()} == {
            "torch.int32", "torch.int64", "torch.float32", "torch.uint8", "torch.bool", "torch.float16"}
        for k, t in got.items():
            assert t.data_ptr() == batch.data[k].ctypes.data, k  # no copy
            assert np.shares_memory(t.numpy(), batch.data[k]), k
        on_cpu = tb.emit(batch, device="cpu")  # a transfer to the CPU is a no-op
        assert all(on_cpu[k].data_ptr() == batch.data[k].ctypes.data for k in batch.data)


def test_tensors_kept_across_steps_survive_a_process_runner():
    """Zero-copy tensors view the runner's reused shared-memory slots; a live tensor keeps its slot."""
    ref = numpy_ref(plan(), 40)
    with tb.TorchLoader(plan(), make_source(), runner=processes(2), read_ahead=32) as loader:
        kept = [next(loader) for _ in range(40)]  # one step per group read: slots cycle
        gc.collect()
        for got, want in zip(kept, ref):
            assert_same(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16"])
def test_bfloat16_is_a_round_to_nearest_cast_of_the_reference(dtype):
    loader = tb.TorchLoader(plan(), make_source(), dtypes={"x": dtype})
    for want in numpy_ref(plan(), 3):
        got = next(loader)
        assert got["x"].dtype == torch.bfloat16 and got["tokens"].dtype == torch.int32
        bits = got["x"].view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(bits, want["x"].astype(ml_dtypes.bfloat16).view(np.uint16))
        assert np.array_equal(got["tokens"].numpy(), want["tokens"])


def test_every_world_size_concatenates_to_the_global_batch():
    ref = numpy_ref(plan(), 3)
    for world in (1, 2, 4, 8):
        loaders = [tb.TorchLoader(plan(), make_source(), rank=r, world=world) for r in range(world)]
        assert [l.loader.owned.tolist() for l in loaders] == [a.tolist() for a in np.split(np.arange(8), world)]
        for want in ref:
            parts = [next(l) for l in loaders]
            assert_same({k: torch.cat([p[k] for p in parts]) for k in want}, want)
    with pytest.raises(PlanError, match="divisible"):
        tb.TorchLoader(plan(), make_source(), rank=0, world=3)


def test_rank_and_world_default_to_a_single_process():
    loader = tb.TorchLoader(plan(), make_source())
    assert (loader.rank, loader.world) == (0, 1)
    with pytest.raises(PlanError, match="both rank and world"):
        tb.data_parallel(rank=1)


def test_object_fields_pass_through_and_cannot_be_cast():
    words = np.array([b"w" * (i % 5) for i in range(N)], dtype=object)
    src = ArraySource({"id": np.arange(N), "raw": words})
    batch = next(Loader(plan(), src))
    got = tb.emit(batch)
    assert isinstance(got["id"], torch.Tensor)
    assert isinstance(got["raw"], np.ndarray) and got["raw"].dtype == object
    assert list(got["raw"]) == [words[i] for i in batch.data["id"]]
    with pytest.raises(PlanError, match="cannot become a torch tensor"):
        tb.emit(batch, dtypes={"raw": torch.int32})
    with pytest.raises(PlanError, match=r"lacks; its fields are \['id', 'raw'\]"):
        tb.emit(batch, dtypes={"rwa": torch.int32})


class ReadOnlySource:
    """Returns read-only, big-endian arrays, as np.frombuffer over bytes would."""

    def __len__(self) -> int:
        return N

    def read(self, indices):
        buf = (np.asarray(indices, ">i4") * 3).tobytes()
        return {"v": np.frombuffer(buf, dtype=">i4")}


def test_read_only_and_byte_swapped_arrays_are_copied_safely(recwarn):
    got = next(tb.TorchLoader(plan(), ReadOnlySource()))
    want = Loader(plan(), ReadOnlySource()).batch(0).data["v"]
    assert got["v"].dtype == torch.int32 and np.array_equal(got["v"].numpy(), want.astype(np.int32))
    got["v"][0] = -1  # writable: it is our copy, not the source's buffer
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_pin_memory_and_device(caplog):
    batch = next(Loader(plan(), make_source()))
    with caplog.at_level(logging.WARNING, logger="zephon.backends.torch"):
        got = tb.emit(batch, pin_memory=True, dtypes={"x": torch.bfloat16}, device="cpu")
    assert np.array_equal(got["tokens"].numpy(), batch.data["tokens"])
    assert got["x"].dtype == torch.bfloat16
    if torch.accelerator.is_available():
        assert all(t.is_pinned() for t in got.values())
    else:  # nothing to pin into here: like DataLoader, warn and go on
        assert "no accelerator" in caplog.text
        assert got["tokens"].data_ptr() == batch.data["tokens"].ctypes.data


# --- state --------------------------------------------------------------------------------------
@pytest.mark.parametrize("filtered", [False, True])
def test_resume_mid_epoch_through_torch_save_weights_only(tmp_path, filtered):
    transforms = (Filter(keep),) if filtered else ()
    ref = numpy_ref(plan(), 10, transforms)
    first = tb.TorchLoader(plan(), make_source(), transforms)
    for want in ref[:4]:  # 4 x 32 rows of a 203-record epoch: mid-epoch
        assert_same(next(first), want)
    torch.save({"data": first.state_dict()}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["data"]
    assert state == first.state_dict() == first.loader.state() and state["step"] == 4
    assert json.loads(json.dumps(state)) == state  # JSON-compatible
    assert isinstance(state["plan"], dict) and all(isinstance(v, dict) for v in state["lanes"].values())
    core = Loader(plan(), make_source(), transforms)  # the same document restores the core loader
    core.restore(state)
    assert_same(tb.emit(next(core)), ref[4])
    resumed = tb.TorchLoader(plan(), make_source(), transforms)
    resumed.load_state_dict(state)
    for want in ref[4:]:
        assert_same(next(resumed), want)
    # the core's JSON files interoperate: a plain Zephon state loads too
    save_state(tmp_path / "state.json", first.loader.state())
    again = tb.TorchLoader(plan(), make_source(), transforms)
    again.load_state_dict(load_state(tmp_path / "state.json"))
    assert_same(next(again), ref[4])


def test_state_from_another_plan_is_refused():
    state = tb.TorchLoader(plan(seed=3), make_source()).state_dict()
    with pytest.raises(StateError, match="another plan"):
        tb.TorchLoader(plan(seed=4), make_source()).load_state_dict(state)
    damaged = {**state, "lanes": {**state["lanes"], "0": '{"cursor": [0]}'}}  # a JSON string
    with pytest.raises(StateError, match="lane 0 of the state is str"):
        tb.TorchLoader(plan(seed=3), make_source()).load_state_dict(damaged)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_distributed_checkpoint_round_trip_in_one_process(tmp_path):
    transforms = (Filter(keep),)
    ref = numpy_ref(plan(), 7, transforms)
    first = tb.TorchLoader(plan(), make_source(), transforms)
    for _ in range(4):
        next(first)
    dcp.save({"data": first.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    resumed = tb.TorchLoader(plan(), make_source(), transforms)
    template = {"data": resumed.state_dict()}  # a fresh loader's state is the template
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"))
    assert template["data"] == first.state_dict()
    resumed.load_state_dict(template["data"])
    for want in ref[4:]:
        assert_same(next(resumed), want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_distributed_checkpoint_of_carries_is_loud_not_silently_wrong(tmp_path):
    """DCP fills only its template's keys: a carry whose structure a fresh loader's template lacks
    must fail the load, never be dropped (every lane of a packing pipeline names held and carry)."""
    transforms = (Filter(keep), Pack(13, drop=PER_RECORD))
    first = tb.TorchLoader(plan(), make_source(), transforms)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    assert all({"held", "carry"} <= set(lane) for lane in state["lanes"].values())
    assert any(lane["carry"] for lane in state["lanes"].values())
    dcp.save({"data": state}, checkpoint_id=str(tmp_path / "dcp"))
    template = {"data": tb.TorchLoader(plan(), make_source(), transforms).state_dict()}
    with pytest.raises(BaseException) as failed:  # dcp wraps it in a CheckpointException
        dcp.load(template, checkpoint_id=str(tmp_path / "dcp"))
    failures = getattr(failed.value, "failures", {})
    assert "Missing key in checkpoint state_dict: data.lanes.0.carry" in str(failed.value) + repr(failures)


# --- DataLoader ---------------------------------------------------------------------------------
# Workers are forked (torch's default on Linux). When an earlier test imported jax, jax warns that
# forking a multithreaded process may deadlock; the workers touch no jax state, and every loader
# below has a timeout, so a stuck worker would fail the test instead of hanging it.
TIMEOUT = 60


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers,runner", [(0, None), (0, threads), (2, None), (2, threads), (3, None)])
def test_dataloader_workers_yield_the_identical_sequence(workers, runner):
    ref = [npb.emit(b) for b in Loader(finite_plan(), make_source())]
    ds = tb.ZephonIterableDataset(finite_plan(), make_source(), runner=runner and runner(2))
    assert len(ds) == len(ref) == 25
    got = list(DataLoader(ds, batch_size=None, num_workers=workers, timeout=TIMEOUT if workers else 0))
    assert len(got) == len(ref)
    for g, want in zip(got, ref):
        assert_same(g, want)


def test_zephon_dataloader_state_counts_consumed_batches_not_prefetched(tmp_path):
    ref = numpy_ref(plan(), 12)
    loader = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), make_source()), num_workers=2,
                                 prefetch_factor=4, timeout=TIMEOUT)
    it = iter(loader)
    for want in ref[:5]:
        assert_same(next(it), want)
    state = loader.state_dict()  # workers have computed up to 8 steps ahead by now
    assert state["step"] == 5
    torch.save(state, tmp_path / "dl.pt")
    resumed = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), make_source()), num_workers=2,
                                  timeout=TIMEOUT)
    resumed.load_state_dict(torch.load(tmp_path / "dl.pt", weights_only=True))
    for want, got in zip(ref[5:9], resumed):  # ref first: zip must not pull a 5th batch
        assert_same(got, want)
    assert resumed.state_dict()["step"] == 9
    # iterating the first loader again continues where the training loop stopped
    for want, got in zip(ref[5:7], loader):
        assert_same(got, want)
    with pytest.raises(StateError, match="superseded"):
        next(it)


def test_filter_pipelines_resume_in_process_and_workers_must_split_the_lanes(monkeypatch):
    transforms = (Filter(keep),)
    ref = numpy_ref(plan(), 6, transforms)
    # ZephonDataLoader's workers split a rank's lanes in equal blocks: W must divide them
    with pytest.raises(PlanError, match=r"num_workers in \[1, 2, 4, 8\] \(or 0\)"):
        tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), make_source(), transforms), num_workers=3)
    with pytest.raises(PlanError, match=r"2 lanes rank 1 owns .*num_workers in \[1, 2\]"):
        tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), make_source(), transforms, rank=1, world=4),
                            num_workers=4)
    # a plain DataLoader cannot join its workers' parts of a step: refused inside worker 0 of 2
    # (faked: torch takes 5 s per worker to tear down workers whose dataset raised)
    monkeypatch.setattr(tb.dataset, "get_worker_info", lambda: SimpleNamespace(id=0, num_workers=2))
    with pytest.raises(PlanError, match="use ZephonDataLoader"):
        next(iter(tb.ZephonIterableDataset(plan(), make_source(), transforms)))
    monkeypatch.undo()
    loader = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), make_source(), transforms))
    for want, got in zip(ref[:3], loader):
        assert_same(got, want)
    resumed = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), make_source(), transforms))
    resumed.load_state_dict(loader.state_dict())
    for want, got in zip(ref[3:], resumed):
        assert_same(got, want)


def interleaved_plan():
    return Source(N).shuffle(3).repeat().lanes(8, "interleaved").batch(32)


def not_one_mod_4(r):
    return int(r["id"]) % 4 != 1


# kind -> (plan, transforms, rank, world, steps or None: the whole finite plan)
KINDS = {
    "one_to_one": lambda: (plan(), (), 0, 1, 6),
    # a finite plan ends when a lane runs out, in one worker's block while the other's lanes
    # still have inputs
    "filter_finite": lambda: (finite_plan(), (Filter(not_one_mod_4),), 0, 1, None),
    "pack": lambda: (plan(), (Filter(keep), Pack(13, drop=PER_RECORD)), 0, 1, 6),  # carries cross step boundaries
    # rank 1 of 2 owns lanes 1, 3, 5, 7; worker 0 runs 1 and 5, worker 1 runs 3 and 7
    "interleaved_rank": lambda: (interleaved_plan(), (Filter(keep),), 1, 2, 6),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zephon_dataloader_batches_are_identical_for_0_1_2_workers(kind):
    p, transforms, rank, world, steps = KINDS[kind]()
    core = Loader(p, make_source(), transforms, rank=rank, world=world)
    ref = [npb.emit(b) for b in (core if steps is None else (next(core) for _ in range(steps)))]
    for workers in (0, 1, 2):
        ds = tb.ZephonIterableDataset(p, make_source(), transforms, rank=rank, world=world)
        loader = tb.ZephonDataLoader(ds, num_workers=workers, timeout=TIMEOUT if workers else 0)
        got = list(loader) if steps is None else [b for _, b in zip(range(steps), loader)]
        assert len(got) == len(ref), workers
        for g, want in zip(got, ref):
            assert_same(g, want)
        assert loader.state_dict()["step"] == (len(ref) if steps is None else steps)
    if kind == "filter_finite":  # a lambda runs (workers start from a fork server: they need a
        # picklable one), but state_dict() needs a stable name
        ds = tb.ZephonIterableDataset(p, make_source(), (Filter(lambda r: int(r["id"]) % 4 != 1),))
        loader = tb.ZephonDataLoader(ds)
        assert len(list(loader)) == len(ref)
        with pytest.raises(StateError, match="no stable identity"):
            loader.state_dict()


def test_state_dict_taken_with_workers_resumes_a_packing_pipeline(tmp_path):
    transforms = (Filter(keep), Pack(13, drop=PER_RECORD))
    ref = numpy_ref(plan(), 9, transforms)
    loader = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), make_source(), transforms),
                                 num_workers=2, prefetch_factor=4, timeout=TIMEOUT)
    it = iter(loader)
    for want in ref[:5]:
        assert_same(next(it), want)
    state = loader.state_dict()  # the workers have computed several steps ahead by now
    assert state["step"] == 5 and sorted(map(int, state["lanes"])) == list(range(8))
    assert any(lane["carry"] for lane in state["lanes"].values())  # rows continue into step 5
    torch.save({"data": state}, tmp_path / "dl.pt")
    loaded = torch.load(tmp_path / "dl.pt", weights_only=True)["data"]
    assert loaded == state and json.loads(json.dumps(loaded)) == loaded
    for workers in (0, 2):
        resumed = tb.ZephonDataLoader(tb.ZephonIterableDataset(plan(), make_source(), transforms),
                                      num_workers=workers, timeout=TIMEOUT if workers else 0)
        resumed.load_state_dict(loaded)
        for want, got in zip(ref[5:8], resumed):  # ref first: zip must not pull a 4th batch
            assert_same(got, want)
        assert resumed.state_dict()["step"] == 8
    core = Loader(plan(), make_source(), transforms)  # the core loader restores the same document
    core.restore(loaded)
    assert_same(tb.emit(next(core)), ref[5])
    # iterating the first loader again continues where the training loop stopped
    for want, got in zip(ref[5:9], loader):
        assert_same(got, want)
    assert loader.state_dict()["step"] == 9
    with pytest.raises(StateError, match="superseded"):
        next(it)


def test_worker_states_of_two_ranks_merge_and_resume_at_other_degrees():
    transforms = (Filter(keep),)
    ref = numpy_ref(plan(), 7, transforms)

    def ranks(world, workers, state=None, steps=3):
        """Each rank's batches of `steps` steps (a ZephonDataLoader per rank) and its state."""
        out, states = [], []
        for r in range(world):
            loader = tb.ZephonDataLoader(
                tb.ZephonIterableDataset(plan(), make_source(), transforms, rank=r, world=world),
                num_workers=workers, timeout=TIMEOUT)
            if state is not None:
                loader.load_state_dict(state)
            out.append([b for _, b in zip(range(steps), loader)])
            states.append(loader.state_dict())
        return [{k: torch.cat([o[s][k] for o in out]) for k in out[0][s]} for s in range(steps)], states

    got, states = ranks(2, 2, steps=4)
    for g, want in zip(got, ref[:4]):
        assert_same(g, want)
    assert [sorted(map(int, s["lanes"])) for s in states] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    merged = merge_states(states)
    for world, workers in ((1, 2), (4, 2)):
        got, _ = ranks(world, workers, merged)
        for g, want in zip(got, ref[4:]):
            assert_same(g, want)


def test_zephon_dataloader_iterates_a_finite_plan_epoch_after_epoch():
    loader = tb.ZephonDataLoader(tb.ZephonIterableDataset(finite_plan(), make_source()))
    assert [len(list(loader)) for _ in range(3)] == [25, 25, 25]  # issue 22: once 25, 0, 0
    with pytest.raises(PlanError, match="ZephonIterableDataset"):
        tb.ZephonDataLoader(make_source())


# --- two processes over gloo ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STEPS, SPLIT = 6, 3


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Runs tests/_torch_ddp_worker.py as ranks 0 and 1 of a gloo group; always ends them."""
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    worker = Path(__file__).with_name("_torch_ddp_worker.py")
    procs, logs = [], [out / f"log{r}.txt" for r in range(2)]
    try:
        for r in range(2):
            with open(logs[r], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(worker), "--out", str(out), "--steps", str(STEPS),
                     "--split", str(SPLIT)], env={**env, "RANK": str(r)}, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))
        for p, log in zip(procs, logs):
            p.wait(timeout=120)
            assert p.returncode == 0, log.read_text()[-3000:]
    finally:
        for p in procs:  # each in its own process group: end the group, forked children too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def single_process_fingerprints(p, source, steps, transforms=()):
    loader = Loader(p, source, transforms)
    return [step_fingerprint(lane_digests(next(loader))) for _ in range(steps)]


def merged_fingerprints(ranks, key):
    """Step fingerprints of the ranks' lane digests under `key`, merged over the ranks."""
    return [step_fingerprint({int(l): d for r in ranks for l, d in r[key][s].items()}) for s in range(STEPS)]


def load_checkpoint(resumed, checkpoint):
    """Restores `resumed` from the ranks' torch.distributed.checkpoint (a fresh state_dict() is the
    template), which the ranks wrote after SPLIT steps."""
    template = {"data": resumed.state_dict()}
    dcp.load(template, checkpoint_id=str(checkpoint))
    assert template["data"]["step"] == SPLIT
    resumed.load_state_dict(template["data"])


@pytest.mark.multiprocess
def test_ddp_ranks_get_exactly_their_rows(ddp_run):
    _, ranks = ddp_run
    assert [(r["rank"], r["world"], r["loader_rank_world"]) for r in ranks] == [(0, 2, [0, 2, 0, 2]),
                                                                                (1, 2, [1, 2, 1, 2])]
    assert [sorted(map(int, r["digests"][0])) for r in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    want = single_process_fingerprints(ddp_worker.pipeline(), ddp_worker.source(), STEPS)
    assert merged_fingerprints(ranks, "digests") == want
    # all_gather of the emitted tensors is the numpy global batch
    assert ranks[0]["gathered"] == ranks[1]["gathered"] == want


@pytest.mark.multiprocess
def test_ddp_dtensor_output_is_the_global_batch(ddp_run):
    _, ranks = ddp_run
    want = single_process_fingerprints(ddp_worker.pipeline(), ddp_worker.source(), STEPS)
    assert ranks[0]["dtensor"] == ranks[1]["dtensor"] == want
    assert [r["dtensor_local_rows"] for r in ranks] == [ddp_worker.BATCH // 2] * 2
    assert all("mapping='contiguous'" in r["interleaved_error"] for r in ranks)


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_ddp_checkpoint_of_two_ranks_resumes_in_one_process(ddp_run):
    out, ranks = ddp_run
    p, transforms = ddp_worker.filtered()
    want = single_process_fingerprints(p, ddp_worker.source(), STEPS, transforms)
    assert merged_fingerprints(ranks, "filtered") == want
    # each rank wrote its own lanes into one torch.distributed.checkpoint; world 1 reads them all
    resumed = tb.TorchLoader(p, ddp_worker.source(), transforms)
    load_checkpoint(resumed, out / "dcp")
    got = []
    for _ in range(SPLIT, STEPS):
        step = resumed.step
        digests = ddp_worker.local_digests(step, next(resumed), resumed)
        got.append(step_fingerprint({int(l): d for l, d in digests.items()}))
    assert got == want[SPLIT:]


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_ddp_ranks_with_dataloader_workers_and_their_checkpoint_resume_in_one_process(ddp_run):
    """Each gloo rank's ZephonDataLoader splits its 4 lanes of a Filter pipeline over 2 workers;
    their checkpoint resumes at world 1 with 2 workers (each then runs 4 lanes)."""
    out, ranks = ddp_run
    p, transforms = ddp_worker.filtered()
    want = single_process_fingerprints(p, ddp_worker.source(), STEPS, transforms)
    assert merged_fingerprints(ranks, "filtered_workers") == want
    resumed = tb.ZephonDataLoader(tb.ZephonIterableDataset(p, ddp_worker.source(), transforms),
                                  num_workers=2, timeout=TIMEOUT)
    load_checkpoint(resumed, out / "dcp_workers")
    owned = p.lanes.owned(0, 1)
    got = [step_fingerprint({int(l): d for l, d in ddp_worker.owned_digests(s, t, p, owned).items()})
           for s, t in zip(range(SPLIT, STEPS), resumed)]
    assert got == want[SPLIT:]

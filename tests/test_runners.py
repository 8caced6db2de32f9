"""Runners change speed, never data: same fingerprints everywhere, clear errors, nothing left behind.

Worker processes re-import this module to unpickle the step function, so every function a worker
runs is defined at module level.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

import numpy as np
import pytest
from _helpers import deadline  # tests/ is on sys.path under pytest's rootdir conftest

from zephon import Loader, Map, PlanError, RandomMap, Source, WorkerError
from zephon.exec.steps import steps_refs
from zephon.fingerprints import lane_digests, step_fingerprint
from zephon.runners import Inline, Processes, Threads, from_spec, inline, processes, threads
from zephon.sources import ArrayRecordSource, ArraySource, FixedFields, write_sharded_array_record

N = 701
SPEC = FixedFields({"tokens": ("int32", (16,)), "label": ("int64", ())})


def plan(batch=32, lanes=8):
    return Source(N).shuffle(5).repeat().lanes(lanes).batch(batch)


def noisy(record, rng):
    return {**record, "noise": rng.integers(0, 1 << 30, size=2)}


def double(cols):
    return {**cols, "tokens": cols["tokens"] * 2}


def explode_past_64(cols):
    if cols["label"].max() >= 64:
        raise ValueError("record 64 is corrupt")
    return cols


def sized(i):
    """Results whose array sizes vary (and grow past a shared-memory slot) plus plain values."""
    return {"i": i, "a": np.full((100 + 400 * (i % 7), 9), i, np.float32), "tiny": np.arange(3) + i,
            "text": f"item {i}", "obj": np.array([b"x" * i, None], dtype=object)}


def die_at_5(i):
    if i == 5:
        os._exit(3)
    return np.full(4096, i, np.int64)


def kill_self_at_3(i):
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return np.full(4096, i, np.int64)


def raise_at_4(i):
    if i == 4:
        raise KeyError(f"no record {i}")
    return np.full(4096, i, np.int64)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1 << 20, size=(N, 16), dtype=np.int32)
    label = np.arange(N, dtype=np.int64)
    prefix = tmp_path_factory.mktemp("ar") / "data"
    write_sharded_array_record(prefix, [SPEC.encode({"tokens": t, "label": l}) for t, l in zip(tokens, label)], 3)
    return str(prefix) + "@3", {"tokens": tokens, "label": label}


def fingerprints(loader, steps):
    """Fingerprints of `steps` batches, computed after all were collected (a runner must never
    reuse memory of a batch the caller still holds)."""
    batches = [next(loader) for _ in range(steps)]
    return [step_fingerprint(lane_digests(b)) for b in batches], batches


def all_runners():
    return [inline(), threads(2), Threads(3, depth=1), processes(2), Processes(1, depth=3)]


def shm_segments(names):
    """Segments anyone could still reach by name: none ever (slots are anonymous memory)."""
    return [n for n in names if os.path.exists(f"/dev/shm/{n}")]


def mapped_segments(names, pids=("self",)):
    """Segments whose memory is still mapped (so alive) in one of `pids`."""
    maps = ""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps += f.read()
        except (FileNotFoundError, ProcessLookupError):
            pass
    return [n for n in names if n in maps]


def alive(pids):
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:  # a zombie is not a process left running
            if f.read().split(")")[-1].split()[0] != "Z":
                out.append(pid)
    return out


def test_steps_refs_equal_per_step_refs():
    p = Source(N).shuffle(1).repeat().lanes(4).batch(12)
    lanes = p.lanes.owned(1, 2)
    got = steps_refs(p, 7, 5, lanes)
    want = [p.refs(s, lanes) for s in range(7, 12)]
    for f in ("source", "record", "epoch"):
        assert np.array_equal(getattr(got, f), np.concatenate([getattr(w, f) for w in want]))


def test_every_runner_and_read_ahead_gives_the_same_fingerprints(records):
    paths, data = records
    src = ArrayRecordSource(paths, SPEC)
    ref, ref_batches = fingerprints(Loader(plan(), src), 40)
    assert np.array_equal(ref_batches[3].data["label"], plan().refs(3).record)
    assert np.array_equal(ref_batches[3].data["tokens"], data["tokens"][plan().refs(3).record])
    for runner in all_runners():
        for read_ahead in (1, 100, None):
            with Loader(plan(), src, runner=runner, read_ahead=read_ahead) as loader:
                got, _ = fingerprints(loader, 40)
            assert got == ref, (runner, read_ahead)


def test_runners_agree_with_transforms_ranks_and_a_finite_plan(records):
    paths, _ = records
    src = ArrayRecordSource(paths, SPEC)
    finite = Source(N).shuffle(2).lanes(4).batch(16)  # 43 full batches, then the end
    transforms = [RandomMap(noisy), Map(double, batched=True)]
    for rank in range(2):
        ref = list(Loader(finite, src, transforms, seed=9, rank=rank, world=2))
        assert len(ref) == 43
        for runner in (threads(2), processes(2)):
            with Loader(finite, src, transforms, seed=9, rank=rank, world=2, runner=runner, read_ahead=50) as l:
                got = list(l)
            assert [lane_digests(b) for b in got] == [lane_digests(b) for b in ref]


def test_seek_and_restore_mid_flight_with_workers(records):
    paths, _ = records
    src = ArrayRecordSource(paths, SPEC)
    ref, _ = fingerprints(Loader(plan(), src), 30)
    with Loader(plan(), src, runner=processes(2), read_ahead=64) as loader:
        head, _ = fingerprints(loader, 5)  # groups beyond step 5 are in flight
        state = loader.state()
        loader.seek(20)
        tail, _ = fingerprints(loader, 10)
        loader.restore(state)
        mid, _ = fingerprints(loader, 15)
        assert loader.batch(29).step == 29
    assert head == ref[:5] and tail == ref[20:30] and mid == ref[5:20]


def test_imap_orders_results_and_survives_growing_results():
    want = [sized(i) for i in range(40)]
    for runner in (Inline(), Threads(3), Processes(2, depth=4), from_spec("processes:1")):
        with deadline(60):
            got = list(runner.imap(sized, range(40)))
        runner.close()
        assert [g["i"] for g in got] == list(range(40))
        for g, w in zip(got, want):
            assert g["text"] == w["text"] and list(g["obj"]) == list(w["obj"])
            assert np.array_equal(g["a"], w["a"]) and np.array_equal(g["tiny"], w["tiny"])
            assert g["a"].flags.writeable  # backends may hand it to torch without a copy


def test_exceptions_keep_their_type_and_earlier_steps_arrive(records):
    paths, _ = records
    src = ArrayRecordSource(paths, SPEC)
    unshuffled = Source(N).lanes(8).batch(32)  # batch k holds records 32k .. 32k+31
    for runner in all_runners():
        with Loader(unshuffled, src, [Map(explode_past_64, batched=True)], runner=runner) as loader:
            assert [int(next(loader).data["label"].max()) for _ in range(2)] == [31, 63]
            for _ in range(2):  # raised again on retry, never a hang or a silent end
                with deadline(30), pytest.raises(ValueError, match="record 64 is corrupt"):
                    next(loader)
            assert loader.step == 2
    with Processes(2) as runner, deadline(30):
        it = runner.imap(raise_at_4, range(10))
        assert [int(next(it)[0]) for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(KeyError, match="no record 4") as info:
            next(it)
        assert "raise_at_4" in str(info.value.__cause__)  # the worker's traceback is chained


@pytest.mark.parametrize("fn, expect", [(die_at_5, "exit code 3"), (kill_self_at_3, "SIGKILL")])
def test_dead_worker_raises_worker_error_and_leaves_nothing(fn, expect):
    runner = Processes(2, depth=4)
    it = runner.imap(fn, range(20))
    with deadline(30), pytest.raises(WorkerError, match=expect):
        for _ in it:
            pass
    pids, segments = runner.pids, runner.segments
    assert pids == [] and segments == []  # the runner shut itself down
    assert list(runner.imap(np.negative, [1, 2])) == [-1, -2]  # and restarts on the next use
    runner.close()


def test_worker_killed_from_outside_is_detected(records):
    paths, _ = records
    loader = Loader(plan(), ArrayRecordSource(paths, SPEC), runner=processes(2), read_ahead=32)
    next(loader)
    next(loader)
    victim = loader.runner.pids[0]
    os.kill(victim, signal.SIGKILL)
    with deadline(30), pytest.raises(WorkerError, match=f"pid {victim}.*SIGKILL"):
        for _ in range(200):
            next(loader)
    loader.close()


def test_close_and_garbage_collection_leave_no_process_or_segment():
    src = ArraySource({"x": np.arange(N * 512, dtype=np.float32).reshape(N, 512)})  # 64 KiB a batch
    loader = Loader(plan(), src, runner=processes(2), read_ahead=64)
    kept = [next(loader) for _ in range(12)]  # batches living in shared memory
    pids, segments = loader.runner.pids, loader.runner.segments
    assert len(alive(pids)) == 2 and mapped_segments(segments) and shm_segments(segments) == []
    loader.close()
    assert alive(pids) == [] and loader.runner.segments == []
    # batches the caller kept stay valid after their slots are released
    ref = Loader(plan(), src)
    assert all(np.array_equal(b.data["x"], ref.batch(b.step).data["x"]) for b in kept)
    del kept
    gc.collect()
    assert mapped_segments(segments) == []  # the memory went with the last batch viewing it

    dropped = Loader(plan(), src, runner=processes(2), read_ahead=64)
    for _ in range(12):
        next(dropped)
    pids, segments = dropped.runner.pids, dropped.runner.segments
    assert mapped_segments(segments, ["self", *pids])
    del dropped  # no close(): collecting the loader ends its workers and frees its memory
    gc.collect()
    assert alive(pids) == [] and mapped_segments(segments) == [] and shm_segments(segments) == []


def test_unpicklable_step_function_is_a_clear_error():
    src = ArraySource({"x": np.arange(N)})
    runner = processes(1)
    with pytest.raises(PlanError, match="cannot be pickled.*threads()"):  # when built (issue 23)
        Loader(plan(), src, [Map(lambda r: r)], runner=runner)
    runner.close()


def test_runner_arguments_are_validated():
    for bad in (lambda: threads(0), lambda: processes(-1), lambda: Processes(2, start_method="nope"),
                lambda: from_spec("gpu")):
        with pytest.raises(ValueError):
            bad()
    assert sys.platform != "linux" or Processes().start_method == "forkserver"


def test_runners_pickle_as_their_configuration():
    import pickle

    runner = Processes(2, depth=3, timeout=9.0)
    assert list(runner.imap(np.negative, [4])) == [-4]
    copy = pickle.loads(pickle.dumps(runner))
    assert (copy.workers, copy.depth, copy.timeout, copy.pids) == (2, 3, 9.0, [])
    runner.close()
    assert pickle.loads(pickle.dumps(Threads(3, depth=5))).depth == 5


def test_shared_memory_stays_bounded_by_the_depth():
    src = ArraySource({"x": np.arange(N * 512, dtype=np.float32).reshape(N, 512)})
    runner = Processes(2, depth=3)
    with Loader(plan(), src, runner=runner, read_ahead=64) as loader:
        most = 0
        for _ in range(300):  # ~150 group results through the slots
            next(loader)
            most = max(most, len(runner.segments))
    assert 1 <= most <= runner.depth + 2  # in flight + the batch being consumed


def test_a_superseded_imap_refuses_to_continue():
    with Processes(2) as runner:
        old = runner.imap(np.negative, range(10))
        assert next(old) == 0
        assert list(runner.imap(np.positive, range(3))) == [0, 1, 2]
        with pytest.raises(RuntimeError, match="abandoned"):
            next(old)


def _same_results_with(method: str) -> None:
    with Processes(2, depth=3, start_method=method) as runner, deadline(120):
        got = list(runner.imap(sized, range(12)))
        assert [g["i"] for g in got] == list(range(12))
        assert all(np.array_equal(g["a"], sized(g["i"])["a"]) for g in got)
        with pytest.raises(KeyError, match="no record 4"):
            list(runner.imap(raise_at_4, range(6)))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_every_start_method_gives_the_same_results(method):
    if method not in __import__("multiprocessing").get_all_start_methods():
        pytest.skip(f"no {method} here")
    if method != "fork":
        _same_results_with(method)
        return
    # fork from a fresh interpreter: this one may have imported JAX, whose threads make a fork
    # here a deadlock risk (and a RuntimeWarning)
    from _helpers import run_group

    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_runners as t; "
            "assert 'jax' not in sys.modules; t._same_results_with('fork'); print('ok')")
    done = run_group([sys.executable, "-c", code], timeout=180, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_runners_satisfy_the_protocol():
    from zephon.runners import Runner, available_cores

    for runner in (inline(), threads(1), processes(1), from_spec("threads:2")):
        assert isinstance(runner, Runner)
    assert available_cores() >= 1


def test_messages_are_frozen_dataclasses_sent_as_plain_tuples():
    import dataclasses
    import pickle

    from zephon.runners.messages import Done, Failed, Run, SetFunction, SlotRef, Stop, decode, encode

    messages = [SetFunction(b"fn"), Stop(),
                Run({"step": 3}, SlotRef("zephon-1-ab-0", 4096), "zephon-1-ab-1", ("x",), True),
                Run(7, None, "f", (), False), Done(b"p"), Done(b"p", ((0, 64), (64, 8)), "s", 8192),
                Failed(None, "KeyError: 4", "Traceback ...")]
    for msg in messages:
        assert pickle.loads(pickle.dumps(msg, protocol=5)) == msg
        assert b"lend" not in pickle.dumps(msg, protocol=5)  # fields travel by position
        wire = pickle.dumps(encode(msg), protocol=5)
        assert b"zephon.runners" not in wire  # the wire holds builtins only: no class lookups
        assert decode(pickle.loads(wire)) == msg
        for f in dataclasses.fields(msg):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(msg, f.name, None)
        assert not hasattr(msg, "__dict__")  # slotted
    with pytest.raises(ValueError, match="not a runner message"):
        decode(("nope", 1))


@pytest.mark.parametrize("kind", ["memfd", "posix", "file"])
def test_every_kind_of_anonymous_segment_is_shared_and_nameless(kind):
    """The transport's fallbacks (POSIX segments without memfd, unlinked files without
    _posixshmem) work on this machine too, and leave no name behind."""
    import mmap
    import socket as socketlib

    from zephon.runners import transport

    if kind == "memfd" and not hasattr(os, "memfd_create"):
        pytest.skip("no memfd_create here")
    label = f"zephon-test-{os.getpid()}-{kind}"
    fd = transport.anonymous_segment(label, 8192, kind=kind)
    a, b = socketlib.socketpair()
    try:
        assert not os.get_inheritable(fd) and os.fstat(fd).st_size == 8192
        assert shm_segments([label]) == []
        transport.send_fd(a, fd)
        theirs = transport.map_fd(transport.recv_fd(b), 8192)  # as a worker would
        ours = transport.map_fd(fd, 8192)
        theirs[:5] = b"hello"
        assert ours[:5] == b"hello"
        ours.close()
        theirs.close()
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError):
        transport.anonymous_segment(label, 4096, kind="nope")
    assert mmap.PAGESIZE <= transport.slot_size(1) <= 2 * mmap.PAGESIZE


MAIN_SCRIPT = '''
import os, sys
with open(sys.argv[1], "a") as f:  # one line each time this script is imported
    f.write(f"{os.getpid()}\\n")

def plus_one(x):
    return x + 1

if __name__ == "__main__":
    import operator
    from zephon.runners import Processes
    with Processes(2, start_method=sys.argv[2]) as runner:
        assert list(runner.imap(operator.neg, range(6))) == [0, -1, -2, -3, -4, -5]
        before = len(open(sys.argv[1]).read().split())
        assert list(runner.imap(plus_one, range(6))) == [1, 2, 3, 4, 5, 6]  # restarts with main
    print(before, len(open(sys.argv[1]).read().split()))
'''


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_import_the_main_script_only_for_functions_defined_there(tmp_path, method):
    """A script's workers skip re-importing it (seconds where it imports a framework) unless the
    function they run is defined in it; then they import it and run it."""
    import subprocess

    script, log = tmp_path / "script.py", tmp_path / "imports.txt"
    script.write_text(MAIN_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(log), method], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert out.split() == ["1", "3"]  # the script itself; then it and the two restarted workers


def test_the_modules_a_function_pickle_names_are_known_before_workers_start():
    """What the forkserver preloads (and whether the workers need the main script)."""
    from zephon.runners.processes import _dumps

    blob, modules = _dumps(Map(double))
    assert {"zephon.ops.map", __name__} <= modules and "__main__" not in modules
    assert __import__("pickle").loads(blob).fn is double


def _native_threads(_):
    from zephon.runners.base import native_threads

    return native_threads()


def test_native_engines_get_their_runners_share_of_the_cores(monkeypatch):
    """tiktoken's engine sizes its threads to this: two runner threads (or worker processes) each
    starting a pool as large as the machine would oversubscribe it."""
    from zephon.runners import available_cores

    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    cores = available_cores()
    assert list(inline().imap(_native_threads, [0])) == [cores]
    share = max(1, cores // 2)
    for runner in (Threads(2), Processes(2)):
        try:
            assert set(runner.imap(_native_threads, range(6))) == {share}, runner
        finally:
            runner.close()


def _storage_endpoint(_: int) -> str:
    return os.environ.get("ZEPHON_TEST_ENDPOINT", "unset")


def test_workers_take_the_consumers_environment_not_the_fork_servers():
    """A fork server's environment is frozen when it first starts; a worker must see the one its
    consumer has when it starts the worker (an object store's endpoint may have changed)."""
    saved = os.environ.get("ZEPHON_TEST_ENDPOINT")
    try:
        os.environ["ZEPHON_TEST_ENDPOINT"] = "http://127.0.0.1:1"
        with Processes(1, start_method="forkserver") as first:  # starts the fork server (if not yet)
            assert list(first.imap(_storage_endpoint, [0])) == ["http://127.0.0.1:1"]
        os.environ["ZEPHON_TEST_ENDPOINT"] = "http://127.0.0.1:2"
        with Processes(1, start_method="forkserver") as second:
            assert list(second.imap(_storage_endpoint, [0])) == ["http://127.0.0.1:2"]
    finally:
        os.environ.pop("ZEPHON_TEST_ENDPOINT", None)
        if saved is not None:
            os.environ["ZEPHON_TEST_ENDPOINT"] = saved

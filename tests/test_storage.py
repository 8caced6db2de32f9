"""Object storage (zephon.storage) against real local servers: SeaweedFS for s3:// (it checks
signatures) and fake-gcs-server for gs://, started here on 127.0.0.1 with free ports and always
stopped; faults injected by an asyncio proxy in front of them. Nothing leaves 127.0.0.1."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from zephon import storage
from zephon.errors import SourceError, StateError
from zephon.testing.fault_proxy import FaultProxy
from zephon.testing.object_servers import create_bucket, start_fake_gcs, start_seaweedfs

BUCKET = "zephon-test"
N = 600
SPEC_FIELDS = {"x": ("int32", (16,))}


def _records() -> list[bytes]:
    return [np.arange(i, i + 16, dtype=np.int32).tobytes() for i in range(N)]


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    """Both servers, the env pointing every client at them, and a local copy of the data."""
    from zephon.sources import write_parquet, write_sharded_array_record

    started, saved = [], dict(os.environ)
    try:
        s3, gcs = start_seaweedfs(), None
        started.append(s3)
        gcs = start_fake_gcs()
        started.append(gcs)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS"):
            os.environ.pop(key, None)
        os.environ.update({**s3.env, **gcs.env, "ZEPHON_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))})
        storage.reset()
        create_bucket(s3, BUCKET)
        create_bucket(gcs, BUCKET)
        local = tmp_path_factory.mktemp("data")
        write_sharded_array_record(local / "ar", _records(), 3)
        rng = np.random.default_rng(0)
        write_parquet(local / "t.parquet", {"id": np.arange(N), "text": np.array(
            [f"doc {i} " + "w" * int(rng.integers(1, 50)) for i in range(N)], dtype=object)},
            row_group_size=64)
        (local / "t.jsonl").write_text("".join(f'{{"id": {i}, "s": "line {i}"}}\n' for i in range(N)))
        for scheme in ("s3", "gs"):
            for f in sorted(local.iterdir()):
                storage.put_atomic(f"{scheme}://{BUCKET}/data/{f.name}", f.read_bytes())
        yield {"s3": s3, "gs": gcs, "local": str(local)}
    finally:
        os.environ.clear()
        os.environ.update(saved)
        storage.reset()
        for server in started:
            server.stop()


def _base(servers, where):
    return servers["local"] if where == "local" else f"{where}://{BUCKET}/data"


def _sources(base):
    from zephon.sources import ArrayRecordSource, FixedFields, JsonlSource, ParquetSource

    return (ArrayRecordSource(f"{base}/ar@3", FixedFields(SPEC_FIELDS)),
            ParquetSource(f"{base}/t.parquet"), JsonlSource(f"{base}/t.jsonl"))


@pytest.mark.parametrize("where", ["s3", "gs"])
def test_sources_read_the_same_records_from_a_bucket_as_from_local_files(servers, where):
    idx = np.random.default_rng(1).permutation(N)[:200]
    for local, remote in zip(_sources(servers["local"]), _sources(_base(servers, where))):
        assert len(remote) == len(local) == N
        got, want = remote.read(idx), local.read(idx)
        assert sorted(got) == sorted(want)
        for k in want:
            assert np.array_equal(got[k], want[k]), (type(local).__name__, k)
    # shard names, globs and a list of URLs resolve like local paths
    from zephon.sources import ArrayRecordSource

    globbed = ArrayRecordSource(f"{_base(servers, where)}/ar-*-of-00003")
    assert globbed.paths == [f"{_base(servers, where)}/ar-0000{i}-of-00003" for i in range(3)]


def _fingerprints(servers, configs, steps=3, formats=("array_record", "parquet", "jsonl")):
    from zephon import Loader, Source
    from zephon.fingerprints import run_fingerprints
    from zephon.runners import inline, processes, threads

    plan = Source(N).shuffle(3).repeat().lanes(4).batch(32)
    runners = {"inline": inline, "threads": lambda: threads(2), "processes": lambda: processes(2)}
    results = {}
    for where in ("local", "s3", "gs"):
        ar, pq, js = _sources(_base(servers, where))
        for world, name in configs:
            for src_name, src in (("array_record", ar), ("parquet", pq), ("jsonl", js)):
                if src_name not in formats:
                    continue
                loaders = [Loader(plan, src, rank=r, world=world, runner=runners[name]())
                           for r in range(world)]
                try:
                    results[(where, world, name, src_name)] = run_fingerprints(loaders, steps)
                finally:
                    for loader in loaders:
                        loader.close()
    for key, value in results.items():
        assert value == results[("local", 1, "inline", key[3])], key
    return results


def test_fingerprints_are_identical_from_s3_gs_and_local_at_every_d_and_runner(servers):
    """D = 1, 2, 4; each runner once (processes ship the pinned sources to workers)."""
    got = _fingerprints(servers, [(1, "inline"), (2, "processes"), (4, "threads")], 2, ("array_record",))
    got.update(_fingerprints(servers, [(1, "inline"), (2, "threads")], 2, ("parquet", "jsonl")))
    assert len(got) == 3 * 3 + 3 * 2 * 2


@pytest.mark.slow
def test_fingerprints_full_matrix_of_storage_d_and_runners(servers):
    configs = [(w, r) for w in (1, 2, 4) for r in ("inline", "threads", "processes")]
    assert len(_fingerprints(servers, configs, steps=6)) == 3 * 9 * 3


@pytest.mark.parametrize("where", ["s3", "gs"])
def test_checkpoints_on_object_storage(servers, where):
    from zephon import load_state, save_state

    url = f"{where}://{BUCKET}/run1/loader.json"
    save_state(url, {"zephon_state": 2, "step": 1})
    save_state(url, {"zephon_state": 2, "step": 2})
    assert load_state(url) == {"zephon_state": 2, "step": 2}
    with pytest.raises(StateError, match=f"{where}://{BUCKET}/run1/nope.json"):
        load_state(f"{where}://{BUCKET}/run1/nope.json")


@pytest.mark.parametrize("where", ["s3", "gs"])
def test_missing_objects_and_shards_are_named(servers, where):
    from zephon.sources import ArrayRecordSource, JsonlSource

    base = _base(servers, where)
    with pytest.raises(SourceError, match="1 of 4 shards are missing|4 of 4 shards are missing"):
        ArrayRecordSource(f"{base}/ar@4")
    with pytest.raises(SourceError, match=f"{base}/none.jsonl"):
        JsonlSource(f"{base}/none.jsonl")
    with pytest.raises(storage.ObjectMissingError, match=f"{base}/none.bin.*404"):
        storage.open_blob(f"{base}/none.bin")


@pytest.mark.parametrize("where", ["s3", "gs"])
def test_an_object_replaced_under_a_source_is_a_source_error_naming_it(servers, where):
    from zephon.sources import JsonlSource, ParquetSource

    url = f"{where}://{BUCKET}/pin/t.jsonl"
    local = os.path.join(servers["local"], "t.jsonl")
    storage.put_atomic(url, Path(local).read_bytes())
    src = JsonlSource(url)
    src.read(np.arange(5))
    storage.put_atomic(url, Path(local).read_bytes().replace(b"line", b"LINE"))
    with pytest.raises(SourceError, match=f"{url}: the object was replaced"):
        src.read(np.arange(5))
    if where == "s3":  # a worker process's storage error reaches the loop as the same error
        from zephon import Loader, Source
        from zephon.runners import processes

        storage.put_atomic(url, Path(local).read_bytes())
        plan = Source(N).shuffle(1).repeat().lanes(4).batch(32)
        with Loader(plan, JsonlSource(url), runner=processes(2), read_ahead=64) as loader:
            next(loader)
            storage.put_atomic(url, Path(local).read_bytes().replace(b"line", b"LINE"))
            with pytest.raises(SourceError, match=f"{url}: the object was replaced"):
                for _ in range(100):
                    next(loader)
    pq_url = f"{where}://{BUCKET}/pin/t.parquet"
    storage.put_atomic(pq_url, Path(servers["local"], "t.parquet").read_bytes())
    pq = ParquetSource(pq_url, cache_row_groups=0)
    storage.put_atomic(pq_url, b"PAR1 not any more")
    with pytest.raises(SourceError, match=f"{pq_url}: the object was replaced"):
        pq.read(np.arange(5))


def test_wrong_s3_keys_are_a_permission_error_naming_the_url_and_not_the_secret(servers, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value-1234")
    storage.reset()
    try:
        with pytest.raises(storage.ObjectPermissionError) as info:
            storage.open_blob(f"s3://{BUCKET}/data/t.jsonl")
    finally:
        monkeypatch.undo()
        storage.reset()
    msg = str(info.value)
    assert f"s3://{BUCKET}/data/t.jsonl" in msg and "AWS_ACCESS_KEY_ID" in msg
    assert "wrong-secret-value-1234" not in msg


@pytest.fixture
def proxied(servers, monkeypatch):
    """Both stores reached through one fault proxy each; fast-failing knobs."""
    proxies = {"s3": FaultProxy(servers["s3"].endpoint), "gs": FaultProxy(servers["gs"].endpoint, rewrite_host=True)}
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxies["s3"].endpoint)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxies["gs"].endpoint)
    old = storage.policy()
    storage.configure(timeout=1.0, deadline=4.0, backoff=0.05, max_backoff=0.3)
    storage.reset()
    yield proxies
    storage.configure(**{f: getattr(old, f) for f in old.__dataclass_fields__})
    monkeypatch.undo()
    storage.reset()
    for p in proxies.values():
        p.close()


@pytest.mark.parametrize("where", ["s3", "gs"])
@pytest.mark.parametrize("fault", ["503", "429", "stall", "reset"])
def test_transient_faults_are_retried_and_give_the_right_bytes(proxied, servers, where, fault):
    from zephon.sources import ArrayRecordSource, FixedFields

    src = ArrayRecordSource(f"{_base(servers, where)}/ar@3", FixedFields(SPEC_FIELDS))
    want = ArrayRecordSource(f"{servers['local']}/ar@3", FixedFields(SPEC_FIELDS)).read(np.arange(0, N, 7))
    f = proxied[where].faults
    f.count = 3
    if fault in ("503", "429"):
        f.status = int(fault)
    elif fault == "stall":
        f.stall = 3.0  # longer than the 1 s request timeout
    else:
        f.reset = True
    retries = storage.STATS["retries"]
    got = src.read(np.arange(0, N, 7))
    assert f.faulted == 3 and storage.STATS["retries"] >= retries + 3
    assert np.array_equal(got["x"], want["x"])


@pytest.mark.parametrize("where", ["s3", "gs"])
def test_a_failing_endpoint_fails_within_the_deadline_naming_url_range_and_attempts(proxied, servers, where):
    """... and every attempt is one HTTP request: obstore's own retries are off, so an outage is
    neither retried twice over (one deadline inside the other) nor hidden inside one attempt."""
    import re

    blob = storage.open_blob(f"{_base(servers, where)}/t.jsonl")
    proxied[where].faults.status, proxied[where].faults.count = 503, -1
    t0 = time.monotonic()
    with pytest.raises(storage.ObjectUnavailableError) as info:
        blob.read(10, 20)
    elapsed = time.monotonic() - t0
    assert 4.0 - 1.0 < elapsed < 4.0 + 1.0  # the deadline, used up and kept
    msg = str(info.value)
    assert f"{blob.url}: reading bytes [10, 30) failed after" in msg
    attempts = int(re.search(r"failed after (\d+) attempts", msg).group(1))
    assert f"(HTTP 503 x{attempts})" in msg
    assert attempts > 6 and proxied[where].faults.faulted == attempts


def test_a_dead_endpoint_fails_within_the_deadline(servers, monkeypatch):
    from zephon.testing.object_servers import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    old = storage.policy()
    storage.configure(timeout=1.0, deadline=3.0, backoff=0.05)
    storage.reset()
    try:
        t0 = time.monotonic()
        with pytest.raises(storage.ObjectUnavailableError, match=f"s3://{BUCKET}/x.bin: reading its "
                           r"size and version \(HEAD\) failed after \d+ attempts .*connection refused"):
            storage.open_blob(f"s3://{BUCKET}/x.bin")
        assert time.monotonic() - t0 < 3.0 + 1.0
    finally:
        storage.configure(**{f: getattr(old, f) for f in old.__dataclass_fields__})
        monkeypatch.undo()
        storage.reset()


def test_the_local_cache_serves_repeated_reads_checks_entries_and_keeps_its_budget(servers, tmp_path, monkeypatch):
    from zephon.sources import ArrayRecordSource, FixedFields
    from zephon.storage import cache

    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path))
    old = storage.policy()
    storage.configure(cache_bytes=6000)
    try:
        src = ArrayRecordSource(f"{_base(servers, 's3')}/ar@3", FixedFields(SPEC_FIELDS))
        want = ArrayRecordSource(f"{servers['local']}/ar@3", FixedFields(SPEC_FIELDS)).read(np.arange(40))
        assert np.array_equal(src.read(np.arange(40))["x"], want["x"])
        before = storage.STATS["requests"]
        assert np.array_equal(src.read(np.arange(40))["x"], want["x"])
        assert storage.STATS["requests"] == before  # every range came from the cache
        entries = sorted(p for p in Path(cache.cache_root()).rglob("*") if p.is_file())
        assert entries
        raw = bytearray(entries[0].read_bytes())
        raw[-1] ^= 0xFF  # a flipped bit in one entry: detected, fetched again, right bytes
        entries[0].write_bytes(bytes(raw))
        assert np.array_equal(src.read(np.arange(40))["x"], want["x"])
        assert storage.STATS["requests"] == before + 1
        src.read(np.arange(100, 400))  # more than the budget: least recently used entries go
        total = sum(p.stat().st_size for p in Path(cache.cache_root()).rglob("*") if p.is_file())
        assert 0 < total <= 6000
    finally:
        storage.configure(cache_bytes=old.cache_bytes)


@pytest.mark.parametrize("where", ["s3", "gs"])
def test_tfds_data_dir_in_a_bucket(servers, where, tmp_path):
    from test_sources import ZephonTinyDataset

    from zephon.sources import TFDSSource

    ZephonTinyDataset(data_dir=str(tmp_path), file_format="array_record").download_and_prepare(
        file_format="array_record")
    for f in tmp_path.rglob("*"):
        if f.is_file() and "downloads" not in f.parts:
            storage.put_atomic(f"{where}://{BUCKET}/tfds/{f.relative_to(tmp_path)}", f.read_bytes())
    local = TFDSSource("zephon_tiny_dataset", "train", data_dir=tmp_path)
    remote = TFDSSource("zephon_tiny_dataset", "train", data_dir=f"{where}://{BUCKET}/tfds")
    idx = np.array([3, 0, 11, 5, 5])
    got, want = remote.read(idx), local.read(idx)
    assert len(remote) == 12 and sorted(got) == sorted(want)
    for k in want:
        assert [np.asarray(v).tolist() for v in got[k]] == [np.asarray(v).tolist() for v in want[k]], k
    with pytest.raises(SourceError, match="Unknown split 'test'"):
        TFDSSource("zephon_tiny_dataset", "test", data_dir=f"{where}://{BUCKET}/tfds")


@pytest.mark.parametrize("where", ["s3", "gs"])
def test_plan_json_and_cli_explain_take_urls(servers, where, capsys):
    from zephon import Source
    from zephon.cli import main
    from zephon.testing import load_plan

    plan = Source(N).shuffle(5).repeat().lanes(4).batch(8)
    url = f"{where}://{BUCKET}/plans/plan.json"
    storage.put_atomic(url, plan.canonical_json().encode())
    assert load_plan(url).fingerprint() == plan.fingerprint()
    assert main(["explain", url, "--step", "2", "--rows", "0:3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [int(line.split()[3]) for line in out[1:4]] == [r["record"] for r in plan.explain(2)[:3]]


# --- outages: the server stopped mid-epoch, then started again over the same data ---------------
# The session's own servers are halted and restarted (same ports, same data): worker processes
# come from a fork server whose environment names those endpoints. Restarts happen on the main
# thread (a server dies with the thread that started it); the loader runs on a helper thread.

OUTAGE_STEPS, OUTAGE_AFTER = 12, 3  # 12 steps of 32 rows: inside the first epoch of 600 rows


def _outage_loader(servers, where, runner):
    from zephon import Loader, Source
    from zephon.runners import inline, processes
    from zephon.sources import ArrayRecordSource, FixedFields

    plan = Source(N).shuffle(11).repeat().lanes(4).batch(32)
    src = ArrayRecordSource(f"{_base(servers, where)}/ar@3", FixedFields(SPEC_FIELDS))
    run = inline() if runner == "inline" else processes(2)
    return Loader(plan, src, runner=run, read_ahead=32)  # one step a read: the outage is met mid-epoch


def _fingerprint(batch) -> str:
    from zephon.fingerprints import lane_digests, step_fingerprint

    return step_fingerprint(lane_digests(batch))


def _through_outage(servers, where, runner, outage: float | None):
    """Fingerprints of OUTAGE_STEPS steps with the server halted after step OUTAGE_AFTER, for
    `outage` seconds (None: until the loader raises); the error, if any; and the times (halt,
    back up, each later batch, the error)."""
    import threading

    server = servers[where]
    loader = _outage_loader(servers, where, runner)
    fps, done, out = [], [], {}
    reached, halted = threading.Event(), threading.Event()

    def consume():
        try:
            for step in range(OUTAGE_STEPS):
                if step == OUTAGE_AFTER:
                    reached.set()
                    halted.wait(60)
                    out["resumed"] = time.monotonic()
                fps.append(_fingerprint(next(loader)))
                done.append(time.monotonic())
        except BaseException as e:  # handed to the test's thread
            out["error"], out["failed"] = e, time.monotonic()

    worker = threading.Thread(target=consume, daemon=True)
    retries = storage.STATS["retries"]
    try:
        worker.start()
        while not reached.wait(0.1):
            assert worker.is_alive(), f"the loader failed before the outage: {out.get('error')!r}"
        out["halting"] = time.monotonic()
        server.halt()
        out["halted"] = time.monotonic()
        halted.set()
        if outage is None:
            worker.join(300)
        else:
            time.sleep(outage)
        out["restarting"] = time.monotonic()
        out["up_in"] = server.restart()
        out["up"] = time.monotonic()
        worker.join(300)
        assert not worker.is_alive(), "the loader hung"
    finally:
        if server.proc.poll() is not None:  # never leave the session's server down
            server.restart()
        loader.close()
        _serving(servers, where)
    out["retries"] = storage.STATS["retries"] - retries
    return fps, done, out


def _serving(servers, where) -> None:
    """Waits (under the default policy: up to 120 s) until the restarted server serves objects
    again, not just answers: the next test starts from a working store."""
    old = storage.policy()
    storage.configure(deadline=120.0, max_backoff=0.5)
    try:
        storage.open_blob(f"{_base(servers, where)}/ar-00000-of-00003").read(0, 16)
    finally:
        storage.configure(**{f: getattr(old, f) for f in old.__dataclass_fields__})


def _outage_case(servers, where, runner, outage, quick=True):
    """The same batches as an uninterrupted run, no error, and the loader really waited."""
    old = storage.policy()
    if quick:  # a short backoff cap: the loader is back within ~1 s of the server (make test)
        storage.configure(max_backoff=1.0)
    try:
        with _outage_loader(servers, where, "inline") as loader:
            want = [_fingerprint(next(loader)) for _ in range(OUTAGE_STEPS)]
        fps, done, out = _through_outage(servers, where, runner, outage)
    finally:
        storage.configure(**{f: getattr(old, f) for f in old.__dataclass_fields__})
    assert "error" not in out, out.get("error")
    assert fps == want
    # a batch after the restart began: the loader waited through the outage (the server may
    # serve a little before restart() has seen it up, so that is not the mark)
    later = [t for t in done if t > out["restarting"]]
    assert later, "every batch came before the server was restarted: the outage was never met"
    print(f"\n{where} {runner}: down {out['up'] - out['halted']:.1f} s (restart {out['up_in']:.1f} s); "
          f"next batch {later[0] - out['up']:+.1f} s from its restart's end; retries in this process "
          f"{out['retries']}; {len(fps)} steps identical")
    if runner == "inline":
        assert out["retries"] > 0


def _deadline_case(servers, where, runner, deadline=2.0):
    old = storage.policy()
    storage.configure(deadline=deadline, max_backoff=1.0)  # travels to the workers with the blobs
    try:
        fps, _, out = _through_outage(servers, where, runner, None)
    finally:
        storage.configure(**{f: getattr(old, f) for f in old.__dataclass_fields__})
    err = out.get("error")
    assert isinstance(err, storage.ObjectUnavailableError), repr(err)
    msg = str(err)
    assert f"{where}://{BUCKET}/data/ar-0000" in msg and "reading bytes [" in msg
    assert "attempts in" in msg and "connection refused" in msg and f"{deadline:g} s" in msg
    # no sooner than the deadline after the server went away (workers read ahead, so their
    # reads may fail from the moment it starts shutting down), no later than it + a few seconds
    assert out["failed"] - out["halting"] > deadline - 0.5, out
    assert out["failed"] - max(out["halted"], out["resumed"]) < deadline + 3.0, out
    assert len(fps) < OUTAGE_STEPS  # no batch came without its bytes (workers read a few ahead)


def test_a_10s_outage_mid_epoch_is_ridden_out_with_the_same_batches(servers):
    """The issue's target, with the default policy (backoff 0.2 s doubling to 10 s)."""
    _outage_case(servers, "s3", "inline", 10.0, quick=False)


@pytest.mark.parametrize("where,runner", [("gs", "inline"), ("s3", "processes"), ("gs", "processes")])
def test_a_short_outage_mid_epoch_is_ridden_out_with_the_same_batches(servers, where, runner):
    _outage_case(servers, where, runner, 2.0)


@pytest.mark.parametrize("where", ["s3", "gs"])
@pytest.mark.parametrize("runner", ["inline", "processes"])
def test_an_outage_past_the_deadline_is_an_error_naming_url_range_and_attempts(servers, where, runner):
    _deadline_case(servers, where, runner)


@pytest.mark.slow
@pytest.mark.parametrize("where,runner", [("gs", "inline"), ("s3", "processes"), ("gs", "processes")])
def test_a_10s_outage_mid_epoch_every_store_and_runner(servers, where, runner):
    _outage_case(servers, where, runner, 10.0, quick=False)
